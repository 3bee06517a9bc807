"""speculative/left_padding.py: prompts right-aligned after padding, with the mask of their tokens."""

from __future__ import annotations

import torch

from quasar_hf.speculative.left_padding import left_padded


def test_rows_are_right_aligned_after_the_pad_id():
    ids, mask = left_padded([[5, 6, 7], [8], torch.tensor([9, 10]), torch.tensor([[11, 12, 13]])], pad=96)
    assert ids.tolist() == [[5, 6, 7], [96, 96, 8], [96, 9, 10], [11, 12, 13]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1], [1, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_the_default_pad_is_zero_and_the_device_is_asked_for():
    ids, mask = left_padded([[3], [4, 5]], device="cpu")
    assert ids.tolist() == [[0, 3], [4, 5]] and mask.tolist() == [[0, 1], [1, 1]]
    assert ids.device.type == mask.device.type == "cpu"
