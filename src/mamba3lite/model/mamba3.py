"""The Mamba-3 mixer (docs/model.md §1-4): projections, discretisation, data-dependent RoPE, gate;
forward/step.

Paper symbols, mapped once (shape letters as docs/architecture.md §6 rule 3):
    z      gate input, (.., E) ................ out = y ⊙ SiLU(z)
    x      SSM input ("V"), (.., H, P) ......... no activation, no conv
    B, C   keys / queries ("K", "Q"), (.., R, G, N), RMS-normed over N, + per-head bias, then rotated
    Δ      step size softplus(a^Δ + dt_bias), (.., H)
    A      decay rate −max(f(a^A), A_floor) < 0, f = heavy-tail (default) or softplus, (.., H)
    λ      trapezoid mix σ(a^λ) ∈ (0, 1), (.., H); λ ≡ 1 is exponential-Euler (Mamba-2)
    θ      rotation angles: θ_t = θ_{t−1} + π·tanh(a^θ_t)·Δ_t (mod 2π), per head, (.., H, S)
    D      skip: y += D·x
The recurrence itself is in `scan.py`. SISO rotates interleaved channel pairs (2i, 2i+1); MIMO rotates
split halves (i, i + N/2), as the official kernels (a wrong pairing does not match official weights).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mamba3lite.model.config import A_ACTIVATIONS, ModelConfig, check_scan_impl
from mamba3lite.model.context_parallel import ContextParallel, rotated_state_correction, state_correction
from mamba3lite.model.decode_state import RowTensors
from mamba3lite.model.rotation import (  # noqa: F401 (pair_views, rotate_, rotation_factors: tests)
    bias_rotate,
    bias_rotate_grads,
    pair_views,
    per_head,
    rotate_,
    rotation_factors,
)
from mamba3lite.model.scan import autocast_dtype, eager_or_traced
from mamba3lite.model.scan_backend import resolve_scan_impl, rotated_scan, scan_function, step_function


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in at least fp32, with a learned gain (init 1), no bias."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return F.rms_norm(xf, (xf.shape[-1],), self.weight.to(xf.dtype), self.eps)


def linear_in_own_dtype(linear: nn.Linear, x: Tensor) -> Tensor:
    """linear(x) with x cast to the weights' dtype: RMSNorm and the scan return ≥ fp32, which a model
    built (or cast) in bf16 cannot multiply; under autocast (fp32 weights) the cast is a no-op."""
    return linear(x.to(linear.weight.dtype))


def heavy_tail(a: Tensor) -> Tensor:
    """f(a) = 1 + a for a ≥ 0 and 1/(1 − a) for a < 0: positive, C¹, linear tail (official HEAD)."""
    return torch.where(a >= 0, 1 + a, 1 / (1 - a.clamp(max=0)))


def _bias_rotate_autograd(k_BGTRN, q_BGTRN, k_bias_HRN, q_bias_HRN, theta_BHTS, halves, out_dtype):
    """`_BiasRotate` in plain, out-of-place autograd ops (real arithmetic): the form torch.compile traces
    (`eager_or_traced`; on the H200 the compiler kept ~1.4x the eager Function's activations)."""
    N = k_BGTRN.shape[-1]
    theta = theta_BHTS.to(k_BGTRN.dtype)[:, :, :, None]  # broadcast over R
    pad = (0, N // 2 - theta.shape[-1])  # pairs past the first S do not rotate: cos 1, sin 0
    cos = F.pad(torch.cos(theta), pad, value=1.0)
    sin = F.pad(torch.sin(theta), pad, value=0.0)
    outs = []
    for x, bias in ((k_BGTRN, k_bias_HRN), (q_BGTRN, q_bias_HRN)):
        pairs = per_head(x, bias).unflatten(-1, (2, N // 2) if halves else (N // 2, 2))
        a, b = pairs.unbind(-2 if halves else -1)
        rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-2 if halves else -1)
        outs.append(rotated.flatten(-2).to(out_dtype))
    return tuple(outs)


class _BiasRotate(torch.autograd.Function):
    """k, q = R(θ)(k̂ + B_bias), R(θ)(q̂ + C_bias) per head, from the per-group normed k̂, q̂ (B, G, T, R, N).

    A Function for memory and speed: autograd would keep ~6 full (B, H, T, R, N) fp32 tensors per layer
    (the biased inputs, swapped copies, full-width cos/sin tables), the largest activations of the layer.
    This keeps the angles (B, H, T, S) and the outputs, which the scan keeps anyway (in the autocast
    dtype under autocast). Forward and backward are rotation.py's `bias_rotate` / `bias_rotate_grads`.
    """

    @staticmethod
    def forward(ctx, k_BGTRN, q_BGTRN, k_bias_HRN, q_bias_HRN, theta_BHTS, halves, out_dtype):
        outs = bias_rotate(k_BGTRN, q_BGTRN, k_bias_HRN, q_bias_HRN, theta_BHTS, halves, out_dtype)
        ctx.save_for_backward(theta_BHTS, *outs)
        ctx.halves, ctx.G, ctx.in_dtype = halves, k_BGTRN.shape[1], k_BGTRN.dtype
        return outs

    @staticmethod
    def backward(ctx, g_k, g_q):
        theta, k, q = ctx.saved_tensors
        grads = bias_rotate_grads(theta, k, q, g_k, g_q, ctx.halves, ctx.G, ctx.in_dtype)
        return *grads, None, None


class _Gate(torch.autograd.Function):
    """x ⊙ SiLU(z), saving x and z only: autograd's two ops would also keep SiLU(z), one more tensor of
    the output's size per layer. The backward recomputes the sigmoid (in fp32, whatever the dtype)."""

    @staticmethod
    def forward(ctx, x, z):
        ctx.save_for_backward(x, z)
        return x * F.silu(z)

    @staticmethod
    def backward(ctx, g):
        x, z = ctx.saved_tensors
        wide = torch.promote_types(g.dtype, torch.float32)
        gf, zf = g.to(wide), z.to(wide)
        sig = torch.sigmoid(zf)
        dx = (gf * zf * sig).to(x.dtype).sum_to_size(x.shape)
        dz = (gf * x.to(wide) * sig * (1 + zf * (1 - sig))).to(z.dtype).sum_to_size(z.shape)
        return dx, dz


def _gate_autograd(x: Tensor, z: Tensor) -> Tensor:
    """`_Gate` in plain autograd ops: the form torch.compile traces."""
    return x * F.silu(z)


class _MimoGate(torch.autograd.Function):
    """MIMO's gate and rank contraction, Σ_r mimo_o_r ⊙ y_r ⊙ SiLU(z ⊙ mimo_z_r): y (B, H, T, R, P),
    z (B, H, T, 1, P), mimo_z and mimo_o (H, R, P) -> (B, H, T, P). Saves y and z only: autograd's ops
    would also keep z ⊙ mimo_z and the gated y, two more rank-expanded tensors of y's size per layer.
    The backward recomputes them (in fp32, whatever the dtype)."""

    @staticmethod
    def forward(ctx, y, z, mimo_z, mimo_o):
        ctx.save_for_backward(y, z, mimo_z, mimo_o)
        return _mimo_gate_autograd(y, z, mimo_z, mimo_o)

    @staticmethod
    def backward(ctx, g):
        y, z, mimo_z, mimo_o = ctx.saved_tensors
        wide = torch.promote_types(g.dtype, torch.float32)
        yf, zf, gf = y.to(wide), z.to(wide), g.to(wide)[:, :, :, None]
        mz, mo = mimo_z.to(wide)[:, None], mimo_o.to(wide)[:, None]  # (H, 1, R, P)
        zm = zf * mz
        sig = torch.sigmoid(zm)
        silu = zm * sig
        g_r = gf * mo
        d_zm = g_r * yf * sig * (1 + zm * (1 - sig))
        dy = (g_r * silu).to(y.dtype)
        dz = (d_zm * mz).sum(3, keepdim=True).to(z.dtype)
        d_mz = (d_zm * zf).sum((0, 2)).to(mimo_z.dtype)
        d_mo = (gf * yf * silu).sum((0, 2)).to(mimo_o.dtype)
        return dy, dz, d_mz, d_mo


def _mimo_gate_autograd(y: Tensor, z: Tensor, mimo_z: Tensor, mimo_o: Tensor) -> Tensor:
    """`_MimoGate` in plain autograd ops: the form torch.compile traces."""
    gated = y * F.silu(z * mimo_z[:, None].to(z.dtype))
    return (gated * mimo_o[:, None].to(y.dtype)).sum(3)


def _gated(y: Tensor, z: Tensor, mimo_z: Tensor | None, mimo_o: Tensor | None) -> Tensor:
    """The gate (and MIMO's rank contraction): y (B, H, T, R, P), z (B, H, T, 1, P) -> (B, H, T, P)."""
    if mimo_z is None:
        return eager_or_traced(_Gate, _gate_autograd)(y, z).squeeze(3)
    return eager_or_traced(_MimoGate, _mimo_gate_autograd)(y, z, mimo_z, mimo_o)


def _gated_out_proj_autograd(y, z, mimo_z, mimo_o, weight) -> Tensor:
    """`_GatedOutProj` in plain autograd ops: the form torch.compile traces."""
    return F.linear(_gated(y, z, mimo_z, mimo_o).transpose(1, 2).flatten(2), weight)


class _GatedOutProj(torch.autograd.Function):
    """out_proj of the gated output, (B, T, D), keeping the gate's inputs (which the gate keeps anyway)
    and not out_proj's input: that is one more (B, T, E) tensor per layer, which the backward gets back
    by redoing the gate (elementwise) instead. The matmuls run in the forward's dtype (the autocast
    dtype under autocast), as out_proj's would."""

    @staticmethod
    def forward(ctx, y, z, mimo_z, mimo_o, weight):
        out = _gated_out_proj_autograd(y, z, mimo_z, mimo_o, weight)
        ctx.save_for_backward(y, z, mimo_z, mimo_o, weight)
        ctx.mm_dtype = out.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        *inputs, weight = ctx.saved_tensors
        if inputs[2] is None:
            return _GatedOutProj._siso_backward(ctx, g, inputs[0], inputs[1], weight)
        leaves = [
            None if t is None else t.detach().requires_grad_(need)
            for t, need in zip(inputs, ctx.needs_input_grad[:4])
        ]
        with torch.enable_grad():
            x = _gated(*leaves).transpose(1, 2).flatten(2)
        dt = ctx.mm_dtype
        g = g.to(dt)
        d_weight = None
        if ctx.needs_input_grad[4]:
            d_weight = (g.flatten(0, -2).mT @ x.detach().to(dt).flatten(0, -2)).to(weight.dtype)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(x, wanted, (g @ weight.to(dt)).to(x.dtype)) if wanted else ())
        return (*(next(grads) if t is not None and t.requires_grad else None for t in leaves), d_weight)

    @staticmethod
    def _siso_backward(ctx, g, y, z, weight):
        """SISO's backward in closed form, y, z (B, H, T, 1, P): with x = y ⊙ SiLU(z) and g_x = g W,
        ∂W = gᵀ x, ∂y = g_x ⊙ SiLU(z), ∂z = g_x ⊙ y ⊙ SiLU'(z) (aten's fused silu_backward). The
        gate's recompute and autograd's re-entry cost ~1/3 of this backward on a CPU at T = 128."""
        dt = ctx.mm_dtype
        g = g.to(dt)
        B, H, T, _, P = y.shape
        wide = torch.promote_types(dt, torch.float32)
        zf = z.to(wide)
        silu = F.silu(zf)
        d_weight = dy = dz = None
        if ctx.needs_input_grad[4]:
            x_BTE = (y * silu).to(dt).view(B, H, T, P).transpose(1, 2).reshape(B * T, H * P)
            d_weight = (g.flatten(0, -2).mT @ x_BTE).to(weight.dtype)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            gx = (g @ weight.to(dt)).to(wide).view(B, T, H, 1, P).transpose(1, 2)  # (B, H, T, 1, P)
            # The head-major operand first: the products take its layout, so the gradients reaching the
            # scan are contiguous (a transposed one made the scan's backward ~20% slower).
            if ctx.needs_input_grad[0]:
                dy = (silu * gx).to(y.dtype)
            if ctx.needs_input_grad[1]:
                dz = torch.ops.aten.silu_backward(y.to(wide) * gx, zf).to(z.dtype)
        return dy, dz, None, None, d_weight


def cumulative_angles(dtheta_BHTS: Tensor, theta0_BHS: Tensor | None, reset_BT: Tensor | None) -> Tensor:
    """θ_t = (θ_{t−1} + dθ_t) mod 2π along T with θ_{−1} = theta0 (or 0), restarting from 0 at resets.

    The running sum is taken in float64 where the device has it (a long fp32 cumsum loses the angle's
    low bits), then wrapped to [0, 2π) and returned in the dtype of dtheta.
    """
    wide = torch.float32 if dtheta_BHTS.device.type == "mps" else torch.float64
    d = dtheta_BHTS.to(wide)
    cs = torch.cumsum(d, dim=2)
    if theta0_BHS is not None:
        cs = cs + theta0_BHS.to(wide)[:, :, None]
    if reset_BT is not None:
        T = d.shape[2]
        # Subtract the exclusive running sum at the latest reset ≤ t (which includes theta0).
        idx_BT = torch.where(reset_BT, torch.arange(T, device=d.device), 0)
        last_BT = torch.cummax(idx_BT, dim=1).values
        excl = cs - d
        base = torch.gather(excl, 2, last_BT[:, None, :, None].expand_as(excl))
        has_reset_BT = torch.cumsum(reset_BT.to(torch.int32), dim=1) > 0
        cs = cs - base * has_reset_BT[:, None, :, None]
    return torch.remainder(cs, 2 * math.pi).to(dtheta_BHTS.dtype)


@dataclass
class Mamba3Cache(RowTensors):
    """Decode state of one layer (docs/model.md §4). Updated in place by `Mamba3.forward(..., state)`/`step`;
    the decode-state protocol (model/decode_state.py) over its rows. A constant size whatever the length.

    angle_BHS: θ of the last token (state dtype); ssm_BHPN: h of the last token (state dtype);
    k_BRHN: biased and rotated key of the last token; v_BHP: raw x of the last token (model dtype).
    """

    angle_BHS: Tensor
    ssm_BHPN: Tensor
    k_BRHN: Tensor
    v_BHP: Tensor


class Mamba3(nn.Module):
    """Mamba-3 mixer with the official layer's constructor arguments and parameter names.

    forward(u_BTD, state=None, reset_BT=None) -> out_BTD: the scan backend `scan_impl` names ("auto",
    "chunked", "sequential", "triton"; model/scan_backend.py), resolved for the device the input is on.
    With a state (`allocate_state`), the scan starts from it and writes the final state back.
    step(u_BD, state, reset_B=None) -> out_BD: one token in O(1), state updated in place.
    `reset_BT[b, t]` true: token t starts a fresh state (packed documents; the LM computes it).
    With a context-parallel group set (`set_context_parallel`), forward scans this rank's piece of the
    window and adds the state the previous pieces leave (model/context_parallel.py).

    Ablations (not official arguments): `trapezoid=False` (λ ≡ 1, the λ projection is dropped) and
    `rope=False` (no rotation, the θ projection is dropped). An official state_dict loads with
    strict=True only with both on (the defaults).
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 128,
        expand: int = 2,
        headdim: int = 64,
        ngroups: int = 1,
        rope_fraction: float = 0.5,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        A_floor: float = 1e-4,
        is_outproj_norm: bool = False,
        is_mimo: bool = False,
        mimo_rank: int = 4,
        chunk_size: int = 64,
        *,
        a_activation: str = "heavy_tail",
        trapezoid: bool = True,
        rope: bool = True,
        scan_impl: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        # ModelConfig validates the shape once, with messages that name the field.
        cfg = ModelConfig(
            d_model=d_model, d_state=d_state, expand=expand, headdim=headdim, ngroups=ngroups,
            rope_fraction=rope_fraction, dt_min=dt_min, dt_max=dt_max, dt_init_floor=dt_init_floor,
            A_floor=A_floor, is_outproj_norm=is_outproj_norm, is_mimo=is_mimo, mimo_rank=mimo_rank,
            chunk_size=chunk_size, a_activation=a_activation, trapezoid=trapezoid, rope=rope,
            scan_impl=scan_impl,
        )  # fmt: skip
        assert a_activation in A_ACTIVATIONS
        fk = {"device": device, "dtype": dtype}
        self.d_model, self.d_state, self.headdim, self.ngroups = d_model, d_state, headdim, ngroups
        self.d_inner, self.nheads, self.num_rope_angles = cfg.d_inner, cfg.nheads, cfg.n_angles
        self.is_mimo, self.mimo_rank, self.chunk_size = is_mimo, cfg.rank, chunk_size
        self.is_outproj_norm, self.A_floor = is_outproj_norm, A_floor
        self.trapezoid, self.rope = trapezoid, rope
        self._make_parameters(fk)
        self._init_dt_bias(dt_min, dt_max, dt_init_floor)

        self._f_A = heavy_tail if a_activation == "heavy_tail" else F.softplus
        self.set_scan_impl(scan_impl)
        self.context_parallel: ContextParallel | None = None

    def _make_parameters(self, fk: dict) -> None:
        """The parameters, with the official layer's names, shapes and order (the order nn.Linear draws
        its initial weights in: an official state_dict loads with strict=True, and a seed gives the same
        model); `fk`: their device and dtype."""
        E, H, N, G, R = self.d_inner, self.nheads, self.d_state, self.ngroups, self.mimo_rank
        S, P, d_model = self.num_rope_angles, self.headdim, self.d_model
        trapezoid, rope = self.trapezoid, self.rope

        # Official split order z, x, B, C, Δ, A, λ, θ; the ablations drop the columns they do not use.
        self._split = [E, E, N * G * R, N * G * R, H, H] + ([H] if trapezoid else []) + ([S] if rope else [])
        self.in_proj = nn.Linear(d_model, sum(self._split), bias=False, **fk)

        self.dt_bias = nn.Parameter(torch.empty(H, **fk))
        self.dt_bias._no_weight_decay = True
        self.B_bias = nn.Parameter(torch.ones(H, R, N, **fk))
        self.C_bias = nn.Parameter(torch.ones(H, R, N, **fk))
        self.B_norm = RMSNorm(N, eps=1e-5, **fk)
        self.C_norm = RMSNorm(N, eps=1e-5, **fk)
        if self.is_mimo:
            self.mimo_x = nn.Parameter(torch.full((H, R, P), 1.0 / R, **fk))
            self.mimo_z = nn.Parameter(torch.ones(H, R, P, **fk))
            self.mimo_o = nn.Parameter(torch.full((H, R, P), 1.0 / R, **fk))
        self.D = nn.Parameter(torch.ones(H, **fk))
        self.D._no_weight_decay = True
        if self.is_outproj_norm:
            self.norm = RMSNorm(E, eps=1e-5, **fk)
        self.out_proj = nn.Linear(E, d_model, bias=False, **fk)

    @classmethod
    def from_config(cls, cfg: ModelConfig, device=None, dtype=None) -> Mamba3:
        """The mixer of one layer of the LM described by `cfg`."""
        return cls(
            cfg.d_model, cfg.d_state, cfg.expand, cfg.headdim, cfg.ngroups, cfg.rope_fraction,
            cfg.dt_min, cfg.dt_max, cfg.dt_init_floor, cfg.A_floor, cfg.is_outproj_norm, cfg.is_mimo,
            cfg.mimo_rank, cfg.chunk_size, a_activation=cfg.a_activation, trapezoid=cfg.trapezoid,
            rope=cfg.rope, scan_impl=cfg.scan_impl, device=device, dtype=dtype,
        )  # fmt: skip

    @torch.no_grad()
    def _init_dt_bias(self, dt_min: float, dt_max: float, floor: float) -> None:
        # Δ₀ log-uniform in [dt_min, dt_max], floored; the bias is softplus⁻¹(Δ₀) = Δ₀ + log(−expm1(−Δ₀)).
        u = torch.rand(self.nheads, device=self.dt_bias.device, dtype=torch.float32)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def set_scan_impl(self, name: str, device: torch.device | str | None = None) -> None:
        """Choose the scan backend of forward: "auto", "chunked", "sequential" or "triton".

        With `device`, the name is resolved for it now (`scan_backend.resolve_scan_impl`: a ConfigError
        here when "triton" cannot run there), as the trainer does once the model is on its device.
        Without, it is resolved at the first forward, for the device of its input, and again whenever
        the input moves to another device type. `scan_impl` is the backend in use (None until resolved).
        """
        check_scan_impl(name, where="scan_impl")
        # Resolved before anything is assigned: a refused choice leaves the layer as it was.
        bound = self._resolve_scan(name, torch.device(device)) if device is not None else (None, None, None)
        self.scan_impl_requested = name
        self.scan_impl, self._scan, self._scan_device_type = bound

    def set_context_parallel(self, cp: ContextParallel | None) -> None:
        """Scan this rank's piece of each window and exchange the state with the other pieces' ranks
        (model/context_parallel.py); None: the whole window is here (no exchange)."""
        self.context_parallel = cp

    def _resolve_scan(self, name: str, device: torch.device) -> tuple[str, Callable, str]:
        """(backend, its scan callable, device type) for the requested `name` on `device`."""
        resolved = resolve_scan_impl(
            name, device, self.mimo_rank, self.d_state, self.headdim, self.chunk_size
        )
        return resolved, scan_function(resolved, self.chunk_size), device.type

    def _bound_scan(self, device: torch.device) -> Callable:
        """The scan callable for `device`: the one bound, else the requested backend resolved for it
        (a forward or step on a new device type), kept."""
        if self._scan_device_type != device.type:
            self.scan_impl, self._scan, self._scan_device_type = self._resolve_scan(
                self.scan_impl_requested, device
            )
        return self._scan

    # ---- pieces shared by forward and step; head-major layout (B, H, T, ...) as the scan wants ----
    def _project(self, u_BTD: Tensor):
        """in_proj, split, per-head scalars. Returns z (B,T,E), x (B,T,H,P), B, C (B,T,R,G,N),
        Δ, A, λ (B,H,T) in ≥ fp32, dθ (B,H,T,S) or None."""
        parts = torch.split(linear_in_own_dtype(self.in_proj, u_BTD), self._split, dim=-1)
        z, x, Bp, Cp, a_dt, a_A = parts[:6]
        sd = torch.promote_types(a_dt.dtype, torch.float32)
        dt = F.softplus(a_dt.transpose(1, 2).to(sd) + self.dt_bias.to(sd)[:, None])
        A = -self._f_A(a_A.transpose(1, 2).to(sd)).clamp(min=self.A_floor)
        lam = torch.sigmoid(parts[6].transpose(1, 2).to(sd)) if self.trapezoid else torch.ones_like(dt)
        dtheta = None
        if self.rope:
            dtheta = math.pi * torch.tanh(parts[-1].to(sd))[:, None] * dt[..., None]
        R, G, N = self.mimo_rank, self.ngroups, self.d_state
        x = x.unflatten(-1, (self.nheads, self.headdim))
        return z, x, Bp.unflatten(-1, (R, G, N)), Cp.unflatten(-1, (R, G, N)), dt, A, lam, dtheta

    def _normed(self, Bp: Tensor, Cp: Tensor) -> tuple[Tensor, Tensor]:
        """BCNorm: (B, T, R, G, N) -> k̂, q̂ (B, G, T, R, N) in ≥ fp32."""
        return self.B_norm(Bp).permute(0, 3, 1, 2, 4), self.C_norm(Cp).permute(0, 3, 1, 2, 4)

    def _qk(self, k_hat: Tensor, q_hat: Tensor, theta_BHTS: Tensor | None) -> tuple[Tensor, Tensor]:
        """Per-head bias, rotation: k̂, q̂ (B, G, T, R, N) -> q, k (B, H, T, R, N), in the autocast dtype
        under autocast (the scan's matmuls would cast them anyway), else the normed dtype."""
        out_dtype = autocast_dtype(k_hat.device.type) or k_hat.dtype
        if theta_BHTS is not None:
            bias_rotate = eager_or_traced(_BiasRotate, _bias_rotate_autograd)
            k, q = bias_rotate(k_hat, q_hat, self.B_bias, self.C_bias, theta_BHTS, self.is_mimo, out_dtype)
            return q, k
        return per_head(q_hat, self.C_bias).to(out_dtype), per_head(k_hat, self.B_bias).to(out_dtype)

    def _raw_values(self, x_BTHP: Tensor) -> Tensor:
        """x (B, T, H, P) -> (B, H, T, 1, P), head-major as the scan wants it."""
        return x_BTHP.transpose(1, 2).contiguous().unsqueeze(3)

    def _values(self, x_BHT1P: Tensor) -> Tensor:
        """x -> v (B, H, T, R, P): x ⊙ mimo_x per rank (MIMO), x itself (SISO)."""
        if self.is_mimo:
            return x_BHT1P * self.mimo_x[:, None].to(x_BHT1P.dtype)
        return x_BHT1P

    def _cache_values(self, x_BHP: Tensor) -> Tensor:
        """Cached raw x (B, H, P) -> v_prev (B, R, H, P)."""
        if self.is_mimo:
            return x_BHP[:, None] * self.mimo_x.transpose(0, 1).to(x_BHP.dtype)
        return x_BHP[:, None]

    def _output(self, y_BHTRP: Tensor, x_BHT1P: Tensor, z_BTE: Tensor) -> Tensor:
        """+ D·v, optional per-head RMSNorm, ⊙ SiLU(z), Σ_r mimo_o, out_proj: -> (B, T, D)."""
        H, P = self.nheads, self.headdim
        # D·v = (D·mimo_x) ⊙ x for MIMO: the skip keeps the raw x for its backward, not the rank copies.
        skip = self.D[:, None, None] * self.mimo_x if self.is_mimo else self.D[:, None, None]
        y = torch.addcmul(y_BHTRP, skip[:, None].to(y_BHTRP.dtype), x_BHT1P)
        if self.is_outproj_norm:
            y = F.rms_norm(y, (P,), eps=self.norm.eps) * self.norm.weight.view(H, 1, 1, P).to(y.dtype)
        amp_dtype = autocast_dtype(y.device.type)
        # out_proj would cast it under autocast (the gate keeps the cast); without autocast it needs the
        # weights' dtype (a model built or cast to bf16: the scan's output is ≥ fp32).
        y = y.to(amp_dtype or self.out_proj.weight.dtype)
        # z is a slice of in_proj's whole output: the gate saves it for backward, so a copy of the slice
        # lets that output (about twice z's size) be freed after the forward. The copy is head-major, as
        # y: the gate's gradients then reach the scan contiguous.
        zr = z_BTE.unflatten(-1, (H, P)).transpose(1, 2).contiguous().unsqueeze(3)  # (B, H, T, 1, P)
        mimo = (self.mimo_z, self.mimo_o) if self.is_mimo else (None, None)
        if not isinstance(self.out_proj, nn.Linear):
            # out_proj was replaced by a wrapper after construction (a PEFT LoRA layer): the fused path
            # below reads its weight only and would bypass the wrapper's own forward.
            return self.out_proj(_gated(y, zr, *mimo).transpose(1, 2).flatten(2))
        gated_out_proj = eager_or_traced(_GatedOutProj, _gated_out_proj_autograd)
        return gated_out_proj(y, zr, *mimo, self.out_proj.weight)

    # ---- public ----
    def forward(
        self, u_BTD: Tensor, state: Mamba3Cache | None = None, reset_BT: Tensor | None = None
    ) -> Tensor:
        if self.context_parallel is not None:
            assert state is None, "decode runs on one process: clear the context-parallel group first"
            return self._forward_piece(u_BTD, reset_BT, self.context_parallel)
        z, x_BTHP, Bp, Cp, dt, A, lam, dtheta = self._project(u_BTD)
        theta_BHTS = None
        if dtheta is not None:
            theta_BHTS = cumulative_angles(dtheta, None if state is None else state.angle_BHS, reset_BT)
        k_hat, q_hat = self._normed(Bp, Cp)
        x = self._raw_values(x_BTHP)
        # The backend is resolved once per device type (the first forward there, or set_scan_impl).
        scan = self._bound_scan(u_BTD.device)
        if state is None and self.scan_impl == "triton":
            # Training's path: bias, rotation (and MIMO's per-rank values) and scan in one op that
            # recomputes the per-head q, k and v in its backward instead of keeping them
            # (scan_triton.triton_rotated_scan).
            mimo_x = self.mimo_x if self.is_mimo else None
            y = rotated_scan(
                k_hat, q_hat, self.B_bias, self.C_bias, theta_BHTS, self.is_mimo, x, A * dt, dt, lam,
                chunk_size=self.chunk_size, reset_BT=reset_BT, v_scale_HRP=mimo_x,
            )[0]  # fmt: skip
            return self._output(y, x, z)
        v = self._values(x)
        q, k = self._qk(k_hat, q_hat, theta_BHTS)
        init = {}
        if state is not None:
            v_prev = self._cache_values(state.v_BHP)
            init = {"h0_BHPN": state.ssm_BHPN, "k_prev_BRHN": state.k_BRHN, "v_prev_BRHP": v_prev}
        y, h_BHPN = scan(q, k, v, A * dt, dt, lam, reset_BT=reset_BT, **init)
        if state is not None and u_BTD.shape[1] > 0:
            with torch.no_grad():
                if theta_BHTS is not None:
                    state.angle_BHS.copy_(theta_BHTS[:, :, -1])
                state.ssm_BHPN.copy_(h_BHPN)
                state.k_BRHN.copy_(k[:, :, -1].transpose(1, 2))
                state.v_BHP.copy_(x_BTHP[:, -1])
        return self._output(y, x, z)

    def _forward_piece(self, u_BTD: Tensor, reset_BT: Tensor | None, cp: ContextParallel) -> Tensor:
        """forward of one context-parallel piece: angles continued from the previous pieces, the piece
        scanned from a zero state, then the incoming state's contribution added (context_parallel.py)."""
        z, x_BTHP, Bp, Cp, dt, A, lam, dtheta = self._project(u_BTD)
        theta_BHTS = None if dtheta is None else cp.angles(dtheta, reset_BT, cumulative_angles)
        k_hat, q_hat = self._normed(Bp, Cp)
        x = self._raw_values(x_BTHP)
        scan = self._bound_scan(u_BTD.device)
        adt = A * dt
        if self.scan_impl == "triton":
            # One contiguous q̂ that the fused scan and the correction both keep (one storage).
            q_hat = q_hat.contiguous()
            mimo_x = self.mimo_x if self.is_mimo else None
            y, h_BHPN = rotated_scan(
                k_hat, q_hat, self.B_bias, self.C_bias, theta_BHTS, self.is_mimo, x, adt, dt, lam,
                chunk_size=self.chunk_size, reset_BT=reset_BT, v_scale_HRP=mimo_x,
            )  # fmt: skip
            last = None if theta_BHTS is None else theta_BHTS[:, :, -1:]
            k_last = self._qk(k_hat[:, :, -1:], q_hat[:, :, -1:], last)[1][:, :, 0]
            v_last = self._values(x[:, :, -1:])[:, :, 0]
            S, w = cp.incoming_state(h_BHPN, k_last, v_last, adt, dt, lam, reset_BT)
            y = rotated_state_correction(y, q_hat, self.C_bias, theta_BHTS, self.is_mimo, S, w)
        else:
            v = self._values(x)
            q, k = self._qk(k_hat, q_hat, theta_BHTS)
            y, h_BHPN = scan(q, k, v, adt, dt, lam, reset_BT=reset_BT)
            S, w = cp.incoming_state(h_BHPN, k[:, :, -1], v[:, :, -1], adt, dt, lam, reset_BT)
            y = state_correction(y, q, S, w)
        return self._output(y, x, z)

    def step(self, u_BD: Tensor, state: Mamba3Cache, reset_B: Tensor | None = None) -> Tensor:
        z, x_BTHP, Bp, Cp, dt, A, lam, dtheta = self._project(u_BD[:, None])  # T = 1
        theta_BHTS = None
        if dtheta is not None:
            prev_BHS = state.angle_BHS.to(dtheta.dtype)
            if reset_B is not None:
                prev_BHS = prev_BHS * (~reset_B).to(prev_BHS.dtype)[:, None, None]
            theta_BHTS = torch.remainder(prev_BHS[:, :, None] + dtheta, 2 * math.pi)
        q, k = self._qk(*self._normed(Bp, Cp), theta_BHTS)
        x = self._raw_values(x_BTHP)
        v = self._values(x)
        self._bound_scan(u_BD.device)
        y_BHRP, h_BHPN = step_function(self.scan_impl)(
            q[:, :, 0], k[:, :, 0], v[:, :, 0], (A * dt)[:, :, 0], dt[:, :, 0], lam[:, :, 0],
            state.ssm_BHPN, state.k_BRHN, self._cache_values(state.v_BHP), reset_B,
        )  # fmt: skip
        with torch.no_grad():
            if theta_BHTS is not None:
                state.angle_BHS.copy_(theta_BHTS[:, :, 0])
            state.ssm_BHPN.copy_(h_BHPN)
            state.k_BRHN.copy_(k[:, :, 0].transpose(1, 2))
            state.v_BHP.copy_(x_BTHP[:, 0])
        return self._output(y_BHRP[:, :, None], x, z)[:, 0]

    def allocate_state(
        self, batch_size: int, max_len: int | None = None, device=None, dtype=None
    ) -> Mamba3Cache:
        """Zero decode state for `batch_size` rows. dtype: model dtype (default: in_proj's); states ≥ fp32.
        `max_len` (the longest sequence it will hold) is ignored: the state's size does not grow."""
        dtype = dtype or self.in_proj.weight.dtype
        device = device or self.in_proj.weight.device
        sd = torch.promote_types(dtype, torch.float32)
        Bsz, H, P, N, R, S = (
            batch_size,
            self.nheads,
            self.headdim,
            self.d_state,
            self.mimo_rank,
            self.num_rope_angles,
        )
        return Mamba3Cache(
            angle_BHS=torch.zeros(Bsz, H, S, device=device, dtype=sd),
            ssm_BHPN=torch.zeros(Bsz, H, P, N, device=device, dtype=sd),
            k_BRHN=torch.zeros(Bsz, R, H, N, device=device, dtype=dtype),
            v_BHP=torch.zeros(Bsz, H, P, device=device, dtype=dtype),
        )
