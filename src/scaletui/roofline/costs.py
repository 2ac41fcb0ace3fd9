"""Parameter, FLOP and KV-cache costs of a LLaMA-style decoder, as pure functions of a ModelSpec.

The book's conventions ("How to Scale Your Model", Austin et al. 2025, Parts 4 and 7):
a matmul [B,D]x[D,F] costs 2BDF FLOPs; forward FLOPs per token = 2*P with P the *total* parameter
count (both embedding tables when untied, as the book counts them); attention dot products are
extra: 4*T*S*N*H per layer forward (QK and AV), halved under a causal mask.
Shape letters: L layers, D d_model, F d_ff, N query heads, K KV heads, H head dim, V vocab,
E experts, k experts per token.
"""

from __future__ import annotations

from scaletui.specs import ModelSpec

__all__ = [
    "active_param_count",
    "attention_flops",
    "dense_flops_per_token",
    "flops_per_token",
    "flops_per_token_by_part",
    "kv_bytes_per_seq",
    "kv_bytes_per_token",
    "param_count",
    "params_by_part",
]


def _experts(model: ModelSpec) -> tuple[int, int]:
    """(E, k): 1, 1 for a dense model."""
    if model.n_experts <= 0:
        return 1, 1
    return model.n_experts, max(model.experts_per_token, 1)


def params_by_part(model: ModelSpec) -> dict[str, int]:
    """Parameter count by part: attention (Q,O: D*N*H each; K,V: D*K*H each), gated MLP (3*D*F,
    times E experts for an MoE, plus a D*E router), norms (2*D per layer + a final D), embeddings
    (D*V input, D*V output unless tied)."""
    L, D, F = model.n_layers, model.d_model, model.d_ff
    N, K, H, V = model.n_heads, model.n_kv_heads, model.head_dim, model.vocab_size
    E, _ = _experts(model)
    router = D * E if model.n_experts > 0 else 0
    return {
        "attention": L * 2 * D * H * (N + K),
        "mlp": L * (3 * D * F * E + router),
        "norms": L * 2 * D + D,
        "embed": D * V,
        "unembed": 0 if model.tied_embeddings else D * V,
    }


def param_count(model: ModelSpec, *, include_norms: bool = True) -> int:
    """Total P: every weight the model holds. The book's tables leave norms out (they are
    ~1e-5 of a 70B model); `include_norms=False` gives the book's exact figure."""
    parts = params_by_part(model)
    if not include_norms:
        parts.pop("norms")
    return sum(parts.values())


def flops_per_token_by_part(model: ModelSpec) -> dict[str, int]:
    """Forward matmul FLOPs per token by part (2 per multiply-add), MoE counting the k active
    experts: attention projections (QKVO), MLP, unembedding. No embedding lookup, no attention
    dot products (see `attention_flops`)."""
    L, D, F = model.n_layers, model.d_model, model.d_ff
    N, K, H, V = model.n_heads, model.n_kv_heads, model.head_dim, model.vocab_size
    E, k = _experts(model)
    router = D * E if model.n_experts > 0 else 0
    return {
        "attention_proj": 2 * L * 2 * D * H * (N + K),
        "mlp": 2 * L * (3 * D * F * k + router),
        "unembed": 2 * D * V,
    }


def dense_flops_per_token(model: ModelSpec) -> int:
    """Matmul FLOPs per token actually done (activated parameters only, no input embedding)."""
    return sum(flops_per_token_by_part(model).values())


def active_param_count(model: ModelSpec) -> int:
    """Parameters touched per token: all of them for a dense model; for an MoE the MLP term is
    3*k*D*F (k active experts) instead of 3*E*D*F, as the book counts activated params."""
    parts = params_by_part(model)
    if model.n_experts > 0:
        E, k = _experts(model)
        parts["mlp"] = model.n_layers * model.d_model * (3 * model.d_ff * k + E)
    return sum(parts.values())


def flops_per_token(model: ModelSpec) -> int:
    """The book's forward FLOPs per token: 2*P with P the total (activated, for an MoE) parameter
    count, both embedding tables included (docs/roofline.md, "Formulas")."""
    return 2 * active_param_count(model)


def attention_flops(model: ModelSpec, q_len: int, kv_len: int, *, causal: bool) -> float:
    """Forward dot-product attention FLOPs for one sequence: QK^T and AV, 2*T*S*N*H each, per
    layer. A causal mask (prefill with q_len == kv_len) halves the useful work."""
    L, N, H = model.n_layers, model.n_heads, model.head_dim
    flops = 4.0 * q_len * kv_len * N * H * L
    return flops / 2 if causal else flops


def kv_bytes_per_token(model: ModelSpec, kv_bytes: float = 2) -> float:
    """KV cache bytes for one token: 2 (K and V) * L * K * H * bytes per element."""
    return 2.0 * model.n_layers * model.n_kv_heads * model.head_dim * kv_bytes


def kv_bytes_per_seq(model: ModelSpec, seq_len: int, kv_bytes: float = 2) -> float:
    """KV cache bytes for one sequence of `seq_len` tokens."""
    return seq_len * kv_bytes_per_token(model, kv_bytes)
