"""A DFlash drafter for transformers: `AutoModel.from_pretrained(folder, trust_remote_code=True)`.

`dflash-host export` writes this file next to config.json and model.safetensors (config.json's
`auto_map` names it). The model computes what the dflash-host drafter computes:

1. The target's hidden states of the `dflash_config.target_layer_ids` layers, concatenated
   [B, S, n * H], are fused by `fc` and `hidden_norm` into a context [B, S, H].
2. Blocks of `block_size` token embeddings [B, A * Bk, H] (per anchor: the anchor's token, then
   the mask token `dflash_config.mask_token_id`, embedded by the target) run through Qwen3
   decoder layers whose attention takes its queries from the blocks and its keys and values from
   [context; blocks]. The query at offset i of the block of anchor a sees the context positions
   before a (on a `sliding_attention` layer only the last `sliding_window` of those up to a + i)
   and its own block (on a sliding layer its keys up to itself), nothing else.
3. The final norm gives [B, A * Bk, H], which the target's LM head turns into draft logits.

RoPE positions: the context at 0 .. S - 1, token i of the block of anchor a at a + i.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

try:  # transformers 5: initialisers that leave weights read from the checkpoint alone
    from transformers import initialization as init
except ImportError:  # transformers 4 initialises only the weights the checkpoint lacks
    from torch.nn import init


class DFlashRMSNorm(nn.Module):
    """RMSNorm over the last dim, normalised in float32 (Qwen3's)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config, device):
    """(inverse frequencies [head_dim / 2], attention scaling) for the config's RoPE."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        half = torch.arange(0, config.head_dim, 2, dtype=torch.int64, device=device).float()
        return 1.0 / (theta ** (half / config.head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, device)


def rope_tables(positions, inv_freq, scaling, dtype):
    """cos and sin [B, 1, L, D] for integer positions [B, L]."""
    freqs = positions.float()[..., None] * inv_freq  # [B, L, D / 2]
    angles = torch.cat([freqs, freqs], dim=-1)
    return (angles.cos() * scaling).to(dtype)[:, None], (angles.sin() * scaling).to(dtype)[:, None]


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def visibility(anchors, context_len, block, window):
    """[B, 1, N, S + N] bool, N = A * block: which of [context; blocks] each block query sees."""
    batch, n_anchors = anchors.shape
    n = n_anchors * block
    device = anchors.device
    anchor_of_query = anchors.repeat_interleave(block, dim=1)[:, :, None]  # [B, N, 1]
    keys = torch.arange(context_len, device=device)[None, None, :]
    context = keys < anchor_of_query
    query = torch.arange(n, device=device)
    if window is not None:
        offset = (query % block)[None, :, None]
        context = context & (keys >= anchor_of_query + offset - (window - 1))
    own = (query // block)[:, None] == (query // block)[None, :]
    if window is not None:
        own = own & (query[None, :] <= query[:, None])
    own = own[None].expand(batch, n, n)
    return torch.cat([context, own], dim=2)[:, None]


class DFlashAttention(nn.Module):
    """Queries from the block tokens, keys and values from [context; blocks]; q/k norms, GQA."""

    def __init__(self, config, window):
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.window = window
        self.q_proj = nn.Linear(hidden, self.heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, hidden, bias=False)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)

    def forward(self, x, context, q_rope, k_rope, mask):
        batch, n, _ = x.shape
        s = context.shape[1]
        both = torch.cat([context, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(batch, n, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(batch, s + n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(batch, s + n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *q_rope), apply_rope(k, *k_rope)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(o.transpose(1, 2).reshape(batch, n, self.heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, window):
        super().__init__()
        self.self_attn = DFlashAttention(config, window)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, context, q_rope, k_rope, masks):
        # The context enters the keys and values as fused, not through input_layernorm.
        x = x + self.self_attn(self.input_layernorm(x), context, q_rope, k_rope, masks[self.self_attn.window])
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """The drafter: `forward(target_hidden, block_embeds, anchors)` -> block hidden states."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        hidden = config.hidden_size
        features = len(config.dflash_config["target_layer_ids"])
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        self.windows = [window if t == "sliding_attention" else None for t in layer_types]
        self.block_size = config.block_size
        self.fc = nn.Linear(features * hidden, hidden, bias=False)
        self.hidden_norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, w) for w in self.windows)
        self.norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, DFlashRMSNorm):
            init.ones_(module.weight)

    def forward(self, target_hidden, block_embeds, anchors):
        """target_hidden [B, S, n * H], block_embeds [B, A * block_size, H], anchors [B, A] (int64)
        -> [B, A * block_size, H] after the final norm."""
        dtype = self.fc.weight.dtype
        target_hidden, x = target_hidden.to(dtype), block_embeds.to(dtype)
        batch, s = target_hidden.shape[:2]
        block = self.block_size
        # 1. The fused context.
        context = self.hidden_norm(self.fc(target_hidden))
        # 2. RoPE at the context's and the blocks' positions; each kind of layer's visibility.
        inv_freq, scaling = rope_inv_freq(self.config, anchors.device)
        block_pos = (anchors[:, :, None] + torch.arange(block, device=anchors.device)).reshape(batch, -1)
        context_pos = torch.arange(s, device=anchors.device)[None].expand(batch, s)
        q_rope = rope_tables(block_pos, inv_freq, scaling, dtype)
        k_rope = rope_tables(torch.cat([context_pos, block_pos], dim=1), inv_freq, scaling, dtype)
        masks = {w: visibility(anchors, s, block, w) for w in set(self.windows)}
        # 3. The layers over the blocks, then the final norm.
        for layer in self.layers:
            x = layer(x, context, q_rope, k_rope, masks)
        return self.norm(x)
