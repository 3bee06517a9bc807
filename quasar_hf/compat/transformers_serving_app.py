"""The classes of `transformers serve`'s OpenAI app that quasar's server subclasses or builds: its
request handlers, model manager, generation manager and state, DirectStreamer and app factory.

They live in `transformers.cli.serving`, the CLI's internals, whose modules and classes change between
releases (tested with Transformers 5.24); serving/transformers_server.py imports them from here. Not
imported by compat/__init__.py: they load FastAPI, which `import quasar_hf` does without.
"""

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import BaseGenerateManager, DirectStreamer, GenerationState

__all__ = [
    "BaseGenerateManager",
    "ChatCompletionHandler",
    "CompletionHandler",
    "DirectStreamer",
    "GenerationState",
    "ModelManager",
    "ResponseHandler",
    "SystemOneHandler",
    "TranscriptionHandler",
    "build_server",
]
