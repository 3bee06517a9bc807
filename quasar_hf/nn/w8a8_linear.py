"""W8A8Linear: an nn.Linear replacement holding INT8 weights, quantizing activations per token;
RotatedW8A8Linear: the same after a Hadamard rotation of its input."""

from __future__ import annotations

import torch
from torch import nn

from quasar_hf.nn.prepared_module import PreparedModule
from quasar_hf.ops import native
from quasar_hf.ops.dispatch import PreparedW8A8, prepare_w8a8, w8a8_linear
from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_float64
from quasar_hf.ops.hadamard_cpu import rotate_rows
from quasar_hf.ops.hadamard_cpu import signs as hadamard_signs
from quasar_hf.ops.reference import quantize_weight_per_channel
from quasar_hf.ops.validation import is_bound_linear_input, validate_w8a8_inputs

ROTATION_OP_DTYPES = (torch.float32, torch.bfloat16)  # rows `quasar::hadamard_rows` takes (others: the reference)


def check_int8_weight(key: str, tensor: object, shape: tuple[int, ...]) -> None:
    """Refuse, naming `key`, a tensor loaded into an int8 W8A8 weight of `shape` that is not an int8 tensor of
    that shape: torch would copy a float tensor into it truncated, silently."""
    if not isinstance(tensor, torch.Tensor):
        return  # torch reports what is not a tensor itself
    if tensor.dtype != torch.int8:
        raise ValueError(
            f"{key}: a {str(tensor.dtype).replace('torch.', '')} tensor cannot load into this int8 W8A8 weight (it would be "
            "truncated to integers). Load the int8 tensors of a Quasar checkpoint "
            "(AutoModelForCausalLM.from_pretrained(quasar_folder)), or quantize float weights with "
            "from_pretrained(float_folder, quantization_config=QuasarConfig())."
        )
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(
            f"{key}: an int8 tensor of shape {list(tensor.shape)} cannot load into this weight of shape {list(shape)}"
        )


class W8A8Linear(PreparedModule):
    """y = dequant(int8(x * act_prescale) @ int8(W).T) + bias, with exact int32 accumulation.

    Serialized state (stable names):
      weight        int8    [out_features, in_features]  symmetric, per output channel
      weight_scale  float32 [out_features]               max|W[n, :]| / 127
      bias          model dtype [out_features]           optional
      act_prescale  float32 [in_features]                optional SmoothQuant 1/s that could
                                                         not be folded into a preceding op
    The kernel is chosen by `backend` through `quasar_hf.ops.dispatch` (one dispatch point) and
    prepared once (validated, packed, bound) by `prepare()`: at construction, after `.to()` /
    `_apply`, `load_state_dict` and copies. After editing a buffer in place, call `prepare()` (or
    `quasar_hf.prepare_weights(model)`): the forward checks nothing and uses what was prepared.
    `of_rms_norm(x, norm_scale, eps)` computes this linear of RMSNorm(x) with the norm folded into the
    activation quantization, in one op (what a NormFoldedW8A8Linear calls).
    """

    derived = ("_prepared",)
    fp32_buffers = ("weight_scale", "act_prescale")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        has_act_prescale: bool = False,
        backend: str = "auto",
        bias_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype or torch.float32, device=device))
        else:
            self.bias = None
        if has_act_prescale:
            self.register_buffer("act_prescale", torch.ones(in_features, dtype=torch.float32, device=device))
        else:
            self.act_prescale = None
        self._prepared: PreparedW8A8 | None = None  # None: not prepared yet, every call dispatches unbound
        self._op_layout: tuple[str, tuple] | None = None  # (quasar:: op name, its arguments after x): prepare
        self._fold_layout: tuple[str, tuple] | None = None  # prepare: the folded op (PreparedW8A8.fold_op)

    @property
    def backend(self) -> str:
        """The W8A8 backend name ("auto" or one of ops.dispatch.BACKENDS); setting it prepares again."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        self._backend = name
        if self.__dict__.get("_prepared") is not None:
            self.prepare()

    @classmethod
    def shaped_like(
        cls, linear: nn.Module, backend: str = "auto", has_act_prescale: bool = False, bias_dtype: torch.dtype | None = None
    ) -> W8A8Linear:
        """An unloaded module (zero int8 weight, unit scales) of `linear`'s shape, bias and device, for the
        tensors a checkpoint or a resume state loads into it next; the bias in `bias_dtype` (default: the
        linear's weight dtype)."""
        return cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            has_act_prescale=has_act_prescale,
            backend=backend,
            bias_dtype=bias_dtype or linear.weight.dtype,
            device=linear.weight.device,
        )

    @classmethod
    def holding(cls, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, backend: str) -> W8A8Linear:
        """A module over these tensors as they are (no copy; int8 [out, in], fp32 [out], optional bias), prepared."""
        module = cls(weight.shape[1], weight.shape[0], bias=bias is not None, backend=backend, device=torch.device("meta"))
        module.register_buffer("weight", weight)
        module.register_buffer("weight_scale", weight_scale)
        if bias is not None:
            module.register_buffer("bias", bias)
        module.prepare()
        return module

    @classmethod
    def from_linear(cls, linear: nn.Linear, act_prescale: torch.Tensor | None = None, backend: str = "auto") -> W8A8Linear:
        """Quantize a float nn.Linear. `act_prescale` [in] is applied to x at run time, not to W."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"W8A8Linear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        return cls.from_weight(linear.weight, linear.bias, act_prescale, backend)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        act_prescale: torch.Tensor | None = None,
        backend: str = "auto",
        rounded: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> W8A8Linear:
        """Quantize a float weight [out, in] (any float dtype; fp32 keeps smoothing exact); bias keeps its dtype.

        `rounded` = (int8 [out, in], fp32 scale [out]) computed elsewhere (GPTQ) replaces nearest rounding.
        """
        out_features, in_features = weight.shape
        module = cls(
            in_features,
            out_features,
            bias=bias is not None,
            has_act_prescale=act_prescale is not None,
            backend=backend,
            bias_dtype=bias.dtype if bias is not None else None,
            device=weight.device,
        )
        q, scale = quantize_weight_per_channel(weight) if rounded is None else rounded
        if q.shape != weight.shape or q.dtype != torch.int8 or scale.shape != (out_features,):
            raise ValueError(
                f"rounded weights must be int8 {tuple(weight.shape)} and scales ({out_features},); "
                f"got {q.dtype} {tuple(q.shape)} and {tuple(scale.shape)}"
            )
        module.weight.copy_(q)
        module.weight_scale.copy_(scale)
        if bias is not None:
            module.bias.copy_(bias.detach())
        if act_prescale is not None:
            if act_prescale.shape != (in_features,):
                raise ValueError(f"act_prescale must have shape ({in_features},), got {tuple(act_prescale.shape)}")
            module.act_prescale.copy_(act_prescale.detach().float())
        module.prepare()
        return module

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        check_int8_weight(f"{prefix}weight", state_dict.get(f"{prefix}weight"), tuple(self.weight.shape))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight this module computes with: W[n, k] = q[n, k] * scale[n] (prescale excluded)."""
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    @property
    def prepared(self) -> PreparedW8A8 | None:
        """The kernel prepared for the current buffers (None: not prepared, or offloaded)."""
        return self._prepared

    def prepare(self) -> None:
        """Validate and pack the buffers and bind the kernel (and its folded form) once. Needed after an
        in-place edit of `weight`, `weight_scale`, `bias` or `act_prescale`."""
        self._prepared = self._op_layout = self._fold_layout = None  # release the old packed weight first
        if self.weight.device.type == "cpu":
            native.is_available()  # the ops' C++ CPU implementations, loaded once (else their Python fallbacks)
        if self.weight.device.type != "meta":  # offloaded or not yet loaded: run unprepared
            self._prepared = prepare_w8a8(self.weight, self.weight_scale, self.bias, self.act_prescale, self.backend)
            self._op_layout = self._prepared.op
            self._fold_layout = self._prepared.fold_op

    @property
    def folds_rms_norm(self) -> bool:
        """Whether `of_rms_norm` runs here: a prepared backend that folds, and no act_prescale."""
        return self._fold_layout is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self._linear(x)

    def of_rms_norm(self, x: torch.Tensor, norm_scale: torch.Tensor, eps: float) -> torch.Tensor | None:
        """W8A8(RMSNorm(x)) [..., in] -> [..., out], the norm folded into the per-token quantization: each row
        of x * norm_scale (fp32 [in], the norm's offset + weight) is quantized as it is, its scale times
        1 / sqrt(mean(x^2) + eps) (reference.w8a8_linear_rmsnorm_reference). One op call; the norm's output
        is never rounded. None where this linear cannot fold (`folds_rms_norm` is False: a backend with no
        folded form, an act_prescale, or not prepared): compute the norm first and call the module."""
        layout = self._fold_layout
        if layout is None:
            return None
        name, args = layout
        return getattr(torch.ops.quasar, name).default(x, norm_scale, eps, *args)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        """One call of the prepared `quasar::` op, eager and compiled alike. It reads only tensors,
        tuples and plain values of this module (the `_op_layout` tuple, not the PreparedW8A8 object),
        so Dynamo can skip this module's guards while its dicts are unchanged (speculative/step_compiler.compiled_step:
        recursive dict tags)."""
        layout = self._op_layout
        if layout is None:  # weights offloaded by accelerate (loaded around this call): unprepared
            return w8a8_linear(x, self.weight, self.weight_scale, self.bias, self.act_prescale, self.backend)
        name, args = layout
        if not is_bound_linear_input(x, self.in_features, args[0].device):
            validate_w8a8_inputs(x, self.weight, self.weight_scale, self.bias, self.act_prescale)  # the precise error
        return getattr(torch.ops.quasar, name).default(x, *args)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, act_prescale={self.act_prescale is not None}, "
            f"weight=int8 per-channel, activations=int8 per-token, backend={self.backend!r}"
            + ("" if self._prepared is None else f" ({self._prepared.backend})")
        )


class RotatedW8A8Linear(W8A8Linear):
    """y = W8A8(x Q) with the int8 weight of W Q: a Hadamard rotation Q spreads outlier channels of x
    before per-token quantization (ops/hadamard.py); in exact arithmetic (x Q)(W Q)^T = x W^T.

    The same serialized state as W8A8Linear, except that `weight`/`weight_scale` quantize W Q, not W
    (build with `from_weight(rotate_weight(W, rotation), ..., rotation)`); Q is `rotation`, a function
    of `in_features` alone. Each row is rotated alone (fp32, a fixed order of operations), then
    quantized and multiplied as in W8A8Linear, and the output cast back to x's dtype: row-stable.
    No act_prescale (rotation replaces smoothing on this input) and never fed by a folded norm.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, **kwargs) -> None:
        if kwargs.get("has_act_prescale"):
            raise ValueError("a RotatedW8A8Linear takes no act_prescale: rotation replaces smoothing on its input")
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.rotation = HadamardRotation.for_size(in_features)
        # prepare(): (H_m on the weight's device, blocks, pow2, scale), what `quasar::hadamard_rows` takes
        self._rotation_op_args: tuple[torch.Tensor, int, int, float] | None = None

    def prepare(self) -> None:
        """Prepare the int8 linear (W8A8Linear.prepare) and the rotation op's arguments."""
        super().prepare()
        r = self.rotation
        if self.weight.device.type != "meta":
            # A copy per module: a tensor shared by 30 modules gets an aliasing guard, which makes Dynamo
            # check each module's guards in full at every call instead of comparing its dict tags.
            signs = hadamard_signs(r).to(self.weight.device, copy=True)
            self._rotation_op_args = (signs, r.blocks, r.pow2, r.scale)
        else:
            self._rotation_op_args = None

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        act_prescale: torch.Tensor | None = None,
        backend: str = "auto",
        rounded: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> RotatedW8A8Linear:
        """`weight` is the rotated float weight W Q [out, in] (`rotate_weight`), or `rounded` its int8 rounding."""
        if act_prescale is not None:
            raise ValueError("a RotatedW8A8Linear takes no act_prescale: rotation replaces smoothing on its input")
        return super().from_weight(weight, bias, None, backend, rounded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] in x.dtype
        args = self._rotation_op_args
        if args is not None and x.dtype in ROTATION_OP_DTYPES and x.device == args[0].device:
            rotated = torch.ops.quasar.hadamard_rows(x, *args)  # fp32 [..., in]
        else:  # not prepared (offloaded weights), or rows the kernels do not take: the reference's bits
            rotated = rotate_rows(x, self.rotation)
        return self._linear(rotated).to(x.dtype)  # never fed by a folded norm; not super(): a guard on the MRO

    def extra_repr(self) -> str:
        r = self.rotation
        return (
            super().extra_repr()
            + f", input rotation Hadamard {r.odd_order}x{r.pow2}"
            + (f" in {r.blocks} blocks" if r.blocks > 1 else "")
        )


def rotate_weight(weight: torch.Tensor, rotation: HadamardRotation) -> torch.Tensor:
    """W [out, in] -> W Q in float64 (the offline side of the rotation; accurate, not row-stable)."""
    return rotate_rows_float64(weight, rotation)
