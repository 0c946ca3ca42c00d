"""Mixture-of-experts MLP: fp32 router (softmax or sigmoid scores, optional correction bias and
group-limited choice), top-k, experts stored stacked and run as grouped GEMMs, optional shared
expert. The settings come from the layer's `MoEMLP` spec (args.py). With latent experts
(`MoEMLP.latent_size`, Nemotron 3 Super), the routed experts work in a narrower latent: one
projection per layer takes the tokens there before them and one takes their weighted sum back;
the router and the shared expert read the full hidden state.

The expert weights are single [E, ...] parameters, so expert parallelism can shard dim 0 from
outside (the trainer's job; no process groups here). Tokens are sorted by expert and each
expert's rows are multiplied in one `torch._grouped_mm` call on CUDA in bf16, or by a loop of
matmuls elsewhere (CPU, fp32): the same math.

Legend: N tokens, D hidden, F expert hidden, E experts, A = N * top_k assignments; the experts'
rows are D wide, or L (the latent) with latent experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from primerl_models.args import Experts, MoEMLP, Routing
from primerl_models.blocks.mlp import dense_mlp


def _use_grouped_mm(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    # torch's private grouped GEMM, which its typing does not re-export (present where _use_grouped_mm)
    return torch._grouped_mm(a, b, offs=offs)  # pyright: ignore[reportPrivateImportUsage]


class _TakeRows(torch.autograd.Function):
    """x[take] whose backward gathers too: row i of the gradient comes from row back[i] of the
    output's (back: the inverse of take), summed over the `k` consecutive rows that took the same
    row of x, in fp32 at least. Autograd's own backward of x[take] scatter-adds each output row into x's
    gradient (atomic adds on CUDA, in the rows' dtype: bf16 roundings in a run-dependent order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, take: torch.Tensor, back: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(back)
        ctx.k = k
        return x[take]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        (back,) = ctx.saved_tensors
        g = grads[0][back]
        if ctx.k > 1:
            wide = torch.promote_types(g.dtype, torch.float32)  # bf16 rows summed in fp32
            g = g.view(-1, ctx.k, g.shape[-1]).to(wide).sum(dim=1).to(g.dtype)
        return g, None, None, None


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The inverse of the permutation `order` (inverse[order[i]] = i), by one scatter, no sort."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))


def take_rows(x: torch.Tensor, take: torch.Tensor, back: torch.Tensor, k: int = 1) -> torch.Tensor:
    """x[take] for a `take` that lists each row of x exactly k times, consecutively in `back`'s
    order: back is the inverse of take's permutation of x's rows repeated k times (row a of
    `back`-order is x's row a // k; take[back[a]] == a // k). Its backward is a gather (and with
    k > 1 a sum over the k copies in a fixed order, in fp32 at least), never a scatter-add."""
    return _TakeRows.apply(x, take, back, k)


class GroupedExperts(nn.Module):
    """E SwiGLU experts: w_gate, w_up [E, D, F]; w_down [E, F, D]; with expert_bias, b_gate,
    b_up [E, F] and b_down [E, D]. Every parameter is stacked on dim 0 (expert parallelism
    shards them all there)."""

    def __init__(self, num_experts: int, dim: int, spec: Experts):
        super().__init__()
        hidden = spec.size
        self.clamp = (spec.limit, spec.alpha) if spec.activation == "clamped" else None
        """(limit, alpha) of the clamped SwiGLU (GPT-OSS); None: silu."""
        self.gated = spec.activation != "relu2"
        """False: relu(up)^2 experts without a gate projection (Nemotron-H)."""
        if self.gated:
            self.w_gate = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, dim))
        if spec.bias:
            self.b_gate = nn.Parameter(torch.zeros(num_experts, hidden))
            self.b_up = nn.Parameter(torch.zeros(num_experts, hidden))
            self.b_down = nn.Parameter(torch.zeros(num_experts, dim))

    def forward(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Rows of x sorted by expert, counts_E rows for each expert -> [A, D]."""
        return self.run(x_AD, counts_E, dict(self.named_parameters(recurse=False)))

    def _act(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        if gate is None:
            return torch.square(F.relu(up))
        if self.clamp is None:
            return F.silu(gate) * up
        limit, alpha = self.clamp
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)

    def _grouped(self, x_AD: torch.Tensor, counts_E: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """CUDA bf16: gate and up as one grouped GEMM of twice the width (one pass over the rows,
        larger tiles); biases added as one-hot [A, E] @ bias [E, .] matmuls, whose backward is a
        matmul too (a gather's backward would scatter-add A rows into E with atomics)."""
        dtype, hidden = x_AD.dtype, weights["w_up"].shape[-1]
        offs = counts_E.cumsum(0).to(torch.int32)
        if "w_gate" not in weights:
            up = _grouped_mm(x_AD, weights["w_up"].to(dtype), offs=offs)
            # relu^2's square runs in fp32 under CUDA autocast (pow is on its fp32 list): back to the GEMM's dtype
            return _grouped_mm(self._act(None, up).to(dtype), weights["w_down"].to(dtype), offs=offs)
        w_gate_up = torch.cat([weights["w_gate"].to(dtype), weights["w_up"].to(dtype)], dim=-1)
        gate_up = _grouped_mm(x_AD, w_gate_up, offs=offs)
        onehot_AE = None
        if "b_gate" in weights:
            expert_A = torch.repeat_interleave(
                torch.arange(len(counts_E), device=x_AD.device), counts_E, output_size=x_AD.shape[0]
            )
            onehot_AE = (expert_A[:, None] == torch.arange(len(counts_E), device=x_AD.device)).to(dtype)
            gate_up = gate_up + onehot_AE @ torch.cat([weights["b_gate"], weights["b_up"]], dim=-1).to(dtype)
        out = _grouped_mm(self._act(gate_up[:, :hidden], gate_up[:, hidden:]), weights["w_down"].to(dtype), offs=offs)
        return out if onehot_AE is None else out + onehot_AE @ weights["b_down"].to(dtype)

    lora_scale: float = 0.0
    """Scale of the experts' low-rank adapters, when primerl_trainer.lora adds them: parameters
    lora_A_<w> [E, in, r] and lora_B_<w> [E, r, out] beside a weight w_<...>, which then acts
    as w + lora_scale lora_A lora_B (stacked on dim 0 like the weights, so expert parallelism
    shards them alike)."""

    @staticmethod
    def with_adapters(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
        """The weights with their adapters folded in (W + scale A B per expert, the product in
        the adapters' dtype, then the weight's), the adapter tensors left out."""
        out = {name: t for name, t in weights.items() if not name.startswith("lora_")}
        for name in out:
            if (a := weights.get(f"lora_A_{name}")) is not None:
                out[name] = out[name] + (scale * torch.bmm(a, weights[f"lora_B_{name}"])).to(out[name].dtype)
        return out

    def run(self, x_AD: torch.Tensor, counts_E: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """The experts' math on the weights given by name (expert parallelism passes its local
        shards: the E here is the experts those weights hold)."""
        if self.lora_scale:
            weights = self.with_adapters(weights, self.lora_scale)
        if _use_grouped_mm(x_AD):
            return self._grouped(x_AD, counts_E, weights)
        w = {name: t.to(x_AD.dtype) for name, t in weights.items()}
        biased = "b_gate" in w
        out = []
        for e, x_e in enumerate(torch.split(x_AD, counts_E.tolist())):
            gate, up = (x_e @ w["w_gate"][e] if "w_gate" in w else None), x_e @ w["w_up"][e]
            if biased:
                assert gate is not None, "expert biases come with gated experts (GPT-OSS)"
                gate, up = gate + w["b_gate"][e], up + w["b_up"][e]
            y = self._act(gate, up) @ w["w_down"][e]
            out.append(y + w["b_down"][e] if biased else y)
        return torch.cat(out) if out else x_AD.new_zeros(x_AD.shape)


class Router(nn.Module):
    """Scores the experts for each token and picks its top_k, in fp32 (small logit differences
    decide which experts run). `weight` [E, D]; with a correction bias, the fp32 buffer
    `e_score_correction_bias` [E] (a buffer, not trained: it balances load in pre-training)."""

    e_score_correction_bias: torch.Tensor | None

    def __init__(self, dim: int, spec: Routing):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, dim))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.bias else None
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, K] fp32, experts [N, K])."""
        s = self.spec
        logits_NE = F.linear(x_ND.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        if s.logit_softcap > 0:
            logits_NE = torch.tanh(logits_NE / s.logit_softcap) * s.logit_softcap
        if s.scoring == "softmax_topk":  # GPT-OSS: the top-k logits, then their softmax
            top_NK, experts_NK = logits_NE.topk(s.top_k, dim=-1)
            return self._finish(top_NK.softmax(dim=-1)), experts_NK
        if s.scoring == "softmax":
            scores_NE = logits_NE.softmax(dim=-1)
        else:
            scores_NE = logits_NE.sigmoid()
        if self.e_score_correction_bias is None and s.n_group == 1:  # Qwen3-MoE: the scores choose
            weights_NK, experts_NK = scores_NE.topk(s.top_k, dim=-1)
            return self._finish(weights_NK), experts_NK
        choice_NE = scores_NE
        if self.e_score_correction_bias is not None:
            choice_NE = scores_NE + self.e_score_correction_bias.float()
        if s.n_group > 1:
            n = choice_NE.shape[0]
            grouped = choice_NE.view(n, s.n_group, -1)
            best_groups_NG = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(s.topk_group, dim=-1).indices
            keep = torch.zeros(n, s.n_group, dtype=torch.bool, device=x_ND.device).scatter_(1, best_groups_NG, True)
            choice_NE = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, -1)
        experts_NK = choice_NE.topk(s.top_k, dim=-1).indices
        return self._finish(scores_NE.gather(1, experts_NK)), experts_NK

    def _finish(self, weights_NK: torch.Tensor) -> torch.Tensor:
        """Renormalisation and scaling of the chosen experts' weights."""
        s = self.spec
        if s.norm_topk_prob:
            weights_NK = weights_NK / (
                weights_NK.sum(dim=-1, keepdim=True) + (1e-20 if s.scoring == "sigmoid" else 0.0)
            )
        if s.scaling != 1.0:
            weights_NK = weights_NK * s.scaling
        return weights_NK


class MoE(nn.Module):
    """Router + experts (+ a shared expert every token goes through, when the spec has one).
    `tokens_per_expert` holds the last forward's assignments per expert (for load-balance
    metrics). It is overwritten, not accumulated, so that the recomputation of activation
    checkpointing (same routing) does not count tokens twice."""

    tokens_per_expert: torch.Tensor

    def __init__(self, dim: int, spec: MoEMLP):
        super().__init__()
        self.top_k, self.num_experts = spec.top_k, spec.num_experts
        self.router = Router(dim, spec.routing)
        self.experts = GroupedExperts(spec.num_experts, spec.expert_dim(dim), spec.experts)
        # latent experts: one pair per layer, not per expert (expert parallelism leaves them whole)
        latent = spec.latent_size
        self.fc1_latent_proj = None if latent is None else nn.Linear(dim, latent, bias=False)
        self.fc2_latent_proj = None if latent is None else nn.Linear(latent, dim, bias=False)
        shared = spec.shared
        self.shared_experts = None if shared is None else dense_mlp(dim, shared.size, shared.activation)
        if shared is not None and shared.gate:
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
        self.register_buffer("tokens_per_expert", torch.zeros(spec.num_experts), persistent=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        shape = x_BTD.shape
        x_ND = x_BTD.reshape(-1, shape[-1])
        device_type = x_ND.device.type
        if torch.is_autocast_enabled(device_type):
            # Autocast leaves the residual stream fp32; the experts run in the autocast dtype
            # (grouped GEMMs take bf16 only).
            x_ND = x_ND.to(torch.get_autocast_dtype(device_type))
        weights_NK, experts_NK = self.router(x_ND)
        rows_NL = x_ND if self.fc1_latent_proj is None else self.fc1_latent_proj(x_ND)
        flat_experts_A = experts_NK.flatten()  # assignment a = token * top_k + slot
        order_A = flat_experts_A.argsort(stable=True)  # sorted position -> assignment
        # scatter_add, not bincount: a fixed output shape keeps torch.compile graphs whole.
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=x_ND.device)
        counts_E.scatter_add_(0, flat_experts_A, torch.ones_like(flat_experts_A))
        position_A = inverse_order(order_A)
        # Both moves are gathers forward and backward (take_rows): the rows to their experts
        # (each token's gradient the fp32 sum of its top_k rows'), then the outputs back to
        # assignment order, for each token's weighted sum of its top_k outputs in fp32.
        out_AL = self.experts(take_rows(rows_NL, order_A // self.top_k, position_A, self.top_k), counts_E)
        out_NKL = take_rows(out_AL, position_A, order_A).view(x_ND.shape[0], self.top_k, -1)
        out_ND = (out_NKL.float() * weights_NK[..., None]).sum(dim=1)
        if self.fc2_latent_proj is not None:  # the sum back to D in the experts' dtype (as transformers)
            out_ND = self.fc2_latent_proj(out_ND.to(x_ND.dtype)).float()
        if self.shared_experts is not None:
            shared_BTD = self.shared_experts(x_BTD)
            if hasattr(self, "shared_expert_gate"):
                shared_BTD = shared_BTD * torch.sigmoid(self.shared_expert_gate(x_BTD))
            out_ND = out_ND + shared_BTD.reshape(out_ND.shape).float()
        with torch.no_grad():
            self.tokens_per_expert.copy_(counts_E)
        return out_ND.to(x_BTD.dtype).view(shape)
