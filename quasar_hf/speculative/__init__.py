"""Quasar speculative generation: cheap drafts, exact verification by the (W8A8) model."""

from . import auto_drafter  # noqa: F401  (registers drafter="auto")
from .config import QuasarGenerationConfig
from .drafters import DRAFTER_FACTORIES, AssistantDrafter, Draft, Drafter, DraftSetup, NgramDrafter, make_drafter
from .loop import QuasarGenerateOutput
from .stats import QuasarStats
from .strategy import speculative_generate
from .verify import greedy_accept, speculative_sample_accept

__all__ = [
    "DRAFTER_FACTORIES",
    "AssistantDrafter",
    "Draft",
    "DraftSetup",
    "Drafter",
    "NgramDrafter",
    "QuasarGenerateOutput",
    "QuasarGenerationConfig",
    "QuasarStats",
    "greedy_accept",
    "make_drafter",
    "speculative_generate",
    "speculative_sample_accept",
]
