"""The vLLM serving check without vLLM: its verdicts on synthetic results, the vLLM plugin's logic,
and a tiny run through export and our own decoding."""

from __future__ import annotations

import sys
import types

import pytest

from benchmarks.serve import vllm_check
from benchmarks.serve.vllm_report import divergence, gap_noise, summarize_model


def test_first_difference_and_compare():
    assert vllm_check.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert vllm_check.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert vllm_check.first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early
    report = vllm_check.compare([[1, 2], [3, 4]], [[1, 2], [3, 5]])
    assert report == {"identical_prompts": 1, "prompts": 2, "first_difference": [None, 1]}


def test_divergence_reports_both_gaps():
    ours, theirs = [5, 6, 7], [5, 8, 7]
    our_top2 = [[[5, 9.0], [1, 2.0]], [[6, 4.0], [8, 3.9]], [[7, 1.0], [2, 0.0]]]
    their_top2 = [[[5, -0.1], [1, -7.0]], [[8, -0.60], [6, -0.65]], [[7, -0.2], [2, -3.0]]]
    row = divergence(ours, theirs, our_top2, their_top2, our_logit_of_theirs=3.9)
    assert row["position"] == 1 and (row["our_token"], row["vllm_token"]) == (6, 8)
    assert row["our_gap"] == pytest.approx(0.1) and row["their_gap"] == pytest.approx(0.05)
    assert row["their_gap_is_lower_bound"] is False
    assert divergence(ours, list(ours), our_top2, their_top2, 0.0) is None
    assert divergence([5], [5, 8], our_top2, their_top2, 0.0) == {"position": 1, "stopped_early": "ours"}
    # where ours is outside vLLM's top 2, its own top-2 gap is a lower bound
    far = divergence(ours, theirs, our_top2, [their_top2[0], [[8, -0.1], [3, -2.5]]], 3.9)
    assert far["their_gap"] == pytest.approx(2.4) and far["their_gap_is_lower_bound"] is True


def test_gap_noise_compares_only_agreeing_positions_with_the_same_top2():
    our_top2 = [[[5, 9.0], [1, 2.0]], [[6, 4.0], [8, 3.0]], [[7, 1.0], [2, 0.0]]]
    their_top2 = [[[5, -0.1], [1, -7.3]], [[6, -0.6], [9, -0.7]], [[7, -0.2], [2, -3.0]]]
    assert gap_noise([5, 6, 7], [5, 6, 4], our_top2, their_top2) == [pytest.approx(0.2)]  # position 1: other top-2


def raw_result(vllm_plain, vllm_ngram, our_logit_of_vllm_token=(None,), served=True) -> dict:
    top2 = [[[1, 5.0], [2, 1.0]], [[3, 2.0], [4, 1.8]]]
    run = {"tokens": [[1, 3]], "seconds": [1.0]}
    modes = {
        "plain": {"tokens": [vllm_plain], "seconds": [0.5], "top2": [[[[1, -0.1], [2, -4.0]], [[4, -0.6], [3, -0.7]]]]},
        "ngram": {"tokens": [vllm_ngram], "seconds": [0.25]},
        "serve": {"answers": [{"text": "ok" if served else "", "completion_tokens": 1, "seconds": 1.0}]},
    }
    return {
        "ours": {"plain": run, "quasar_eager": run},
        "vllm": {"modes": modes},
        "ours_top2": [top2],
        "ours_logit_of_vllm_token": list(our_logit_of_vllm_token),
    }


def test_summary_passes_identical_and_near_tie_runs_and_fails_the_rest():
    same = summarize_model(raw_result([1, 3], [1, 3]), near_tie=0.5)
    assert same["passed"] is True and same["tokens_per_s"]["vllm ngram"] == 8.0
    near = summarize_model(raw_result([1, 4], [1, 4], our_logit_of_vllm_token=[1.8]), near_tie=0.5)
    assert near["passed"] is True and near["divergences"][0]["our_gap"] == pytest.approx(0.2)
    assert summarize_model(raw_result([1, 4], [1, 4], our_logit_of_vllm_token=[1.8]), near_tie=0.1)["passed"] is False
    assert summarize_model(raw_result([1, 3], [1, 4]), near_tie=0.5)["ngram_equals_plain"] is False
    assert summarize_model(raw_result([1, 3], [1, 3], served=False), near_tie=0.5)["passed"] is False
    missing = raw_result([1, 3], [1, 3])
    missing["vllm"] = {"modes": {}, "error": "worker exited with status 1"}
    assert summarize_model(missing, near_tie=0.5)["passed"] is False


class _Platform:
    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu

    def is_cpu(self) -> bool:
        return self.cpu


def stub_transform_class():
    """The parts of vLLM 0.32's HadamardTransform the plugin touches: weight.partitions, transforms,
    process_weights_after_loading (which scales the stored +-1 matrix by 1/sqrt(b))."""
    import torch

    class HadamardTransform(torch.nn.Module):
        def __init__(self, matrix: torch.Tensor, inverse: bool = False) -> None:
            super().__init__()
            self.weight = types.SimpleNamespace(partitions={0: torch.nn.Parameter(matrix.clone(), requires_grad=False)})
            self.transforms = {0: types.SimpleNamespace(args=types.SimpleNamespace(inverse=inverse))}

        def process_weights_after_loading(self) -> None:
            data = self.weight.partitions[0].data
            data.div_(data.shape[0] ** 0.5)

        def forward(self, value: torch.Tensor) -> torch.Tensor:  # vLLM's dense branch
            weight = self.weight.partitions[0]
            weight = weight if self.transforms[0].args.inverse else weight.T
            return self.cpu_linear(value.to(weight.dtype), weight, None).to(value.dtype)

    return HadamardTransform


def install_stub_vllm(monkeypatch, cpu: bool, transform) -> None:
    stubs = {
        "vllm": types.ModuleType("vllm"),
        "vllm.platforms": types.SimpleNamespace(current_platform=_Platform(cpu)),
        "vllm.model_executor.layers.quantization.compressed_tensors.transform.module": types.SimpleNamespace(
            HadamardTransform=transform
        ),
    }
    for name in ("vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.quantization"):
        stubs[name] = types.ModuleType(name)
    for name in ("compressed_tensors", "compressed_tensors.transform"):
        stubs[f"vllm.model_executor.layers.quantization.{name}"] = types.ModuleType(name)
    for name, module in stubs.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("cpu", [True, False])
def test_vllm_plugin_installs_only_on_cpu_and_only_once(monkeypatch, cpu):
    import quasar_vllm

    transform = stub_transform_class()
    original = transform.process_weights_after_loading
    install_stub_vllm(monkeypatch, cpu, transform)
    quasar_vllm.register()
    quasar_vllm.register()  # vLLM calls it in every process: idempotent
    assert hasattr(transform, "cpu_linear") is cpu
    assert (transform.process_weights_after_loading is original) is not cpu  # wrapped once, on CPU only


def test_vllm_plugin_leaves_a_vllm_with_its_own_cpu_linear_alone(monkeypatch):
    import quasar_vllm

    transform = stub_transform_class()
    transform.cpu_linear = own = staticmethod(lambda x, w, b=None: x)
    install_stub_vllm(monkeypatch, True, transform)
    quasar_vllm.register()
    assert transform.__dict__["cpu_linear"] is own


@pytest.mark.parametrize("size", [96, 1536, 4864])  # Paley 12 x 8, 12 x 128, 76 x 64
@pytest.mark.parametrize("inverse", [False, True])
def test_plugin_applies_our_exported_rotation(monkeypatch, size, inverse):
    import torch

    import quasar_vllm
    from quasar_hf.export.ct_transforms import hadamard_block
    from quasar_hf.ops.hadamard import HadamardRotation

    transform = stub_transform_class()
    install_stub_vllm(monkeypatch, True, transform)
    quasar_vllm.register()
    rotation = HadamardRotation.for_size(size)
    module = transform(hadamard_block(rotation).to(torch.bfloat16), inverse=inverse)  # as loaded from the export
    module.process_weights_after_loading()
    a_t, b = module._quasar_split
    assert a_t.shape == (rotation.odd_order, rotation.odd_order)  # the Paley factor, found exactly
    stored = module.weight.partitions[0].data.double()
    x = torch.randn(5, size, generator=torch.Generator().manual_seed(size)).to(torch.bfloat16)
    y = module(x)
    exact = x.double() @ (stored.t() if inverse else stored)
    assert y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs().max() / exact.abs().max()) < 2**-7  # one bf16 rounding of the output
    if not inverse:  # and it is our rotation (up to bf16's rounding of 1/sqrt(b))
        exact_q = x.double() @ rotation.matrix()
        assert (exact - exact_q).abs().max() < 0.01 * exact_q.abs().max()
    module._quasar_split = None  # the dense fallback vLLM would run
    dense = module(x)
    assert ((dense.double() - exact).abs().max() / exact.abs().max()) < 2**-6


def test_kronecker_split_refuses_what_does_not_split():
    import torch

    from quasar_vllm import kronecker_split

    assert kronecker_split(torch.randn(12, 12, generator=torch.Generator().manual_seed(0))) is None
