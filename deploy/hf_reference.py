"""HF transformers on PyTorch as the reference of `actx verify --reference`: the checkpoint
a run names, loaded as transformers loads it, run on one document at a time, with every
actx hook read from it.

Hooks as actx names them (README, "Extraction API"): `embed` is HF's hidden_states[0];
`layers.{i}.resid_pre` the input of layer i; `attn_out` / `mlp_out` what attention / the
MLP add to the residual stream (after Gemma's post-norms); `resid_mid` their sum with
resid_pre; `resid_post` the output of layer i (before the final norm, also for the last
layer); `final_norm` HF's hidden_states[-1]. Imported only by `actx verify --reference`:
torch and transformers are the `torch` extra.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import numpy as np

from actx.schemas import errors
from actx.schemas import store as store_lib

MISSING = ("--reference recomputes with HF transformers on PyTorch, which are not installed "
           "here: pip install 'actx-lm[torch]'")
# What transformers reads from a checkpoint directory (a gs:// one is copied here first).
_CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors",
                     "model.safetensors.index.json")


class ReferenceUnavailable(errors.UserError, RuntimeError):
    """The reference cannot run here: torch or transformers missing, no checkpoint."""


def require_torch() -> None:
    """Raises ReferenceUnavailable, in one line, when torch or transformers is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise ReferenceUnavailable(MISSING) from None


@dataclasses.dataclass
class HFReference:
    """A loaded HF model: `model` in float32, eager attention, eval mode, on `device`."""

    model: object
    device: str
    described: str

    @property
    def text_config(self):
        return getattr(self.model.config, "text_config", self.model.config)

    @property
    def num_layers(self) -> int:
        return len(_layers(self.model))


def load(model_path: str, device: str = "cpu") -> HFReference:
    """The checkpoint at `model_path` (local or gs://) as the float32 PyTorch reference."""
    require_torch()
    import torch
    import transformers

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ReferenceUnavailable(f"--device {device}: torch {torch.__version__} sees no "
                                   f"CUDA device here; use --device cpu")
    local = _local_copy(model_path)
    with open(os.path.join(local, "config.json")) as f:
        arch = (json.load(f).get("architectures") or [""])[0]
    auto = (getattr(transformers, arch) if arch == "Gemma3ForConditionalGeneration"
            else transformers.AutoModelForCausalLM)
    model = auto.from_pretrained(local, dtype=torch.float32, attn_implementation="eager")
    # float32 whatever the checkpoint's dtype and however this transformers reads `dtype`.
    model = model.to(device=device, dtype=torch.float32).eval()
    return HFReference(model, device, f"transformers {transformers.__version__} on torch "
                                      f"{torch.__version__} ({device}), float32")


def _local_copy(model_path: str) -> str:
    """A local directory holding the checkpoint's files (a gs:// one copied)."""
    store = store_lib.open_store(model_path)  # the model's checkpoint, not the run
    if store.location.is_local:
        if not os.path.isfile(os.path.join(store.location.path, "config.json")):
            raise ReferenceUnavailable(f"{store.location.join('config.json')}: not found; the "
                                       f"run's model.path is not a checkpoint directory here")
        return store.location.path
    local = tempfile.mkdtemp(prefix="actx-reference-")
    index = store.read_json("model.safetensors.index.json")
    names = set(_CHECKPOINT_FILES) | set((index or {}).get("weight_map", {}).values())
    for name in sorted(names):
        data = store.read(name)
        if data is not None:
            with open(os.path.join(local, name), "wb") as f:
                f.write(data)
    if not os.path.exists(os.path.join(local, "config.json")):
        raise ReferenceUnavailable(f"{store.location.join('config.json')}: not found")
    return local


def _decoder(model):
    """The decoder stack: `model` (Llama-shaped), `transformer` (GPT-2), `gpt_neox`."""
    inner = (getattr(model, "model", None) or getattr(model, "transformer", None)
             or model.gpt_neox)
    return getattr(inner, "language_model", inner)


def _layers(model):
    """The decoder's blocks (GPT-2 calls them `h`)."""
    inner = _decoder(model)
    return inner.h if hasattr(inner, "h") else inner.layers


def masks(ref: HFReference, context_start: np.ndarray):
    """What HF must be given so that token p of a document sees what it saw in the run:
    its document's positions context_start[p] .. p, and, in layers with a window of their
    own (Mistral, Gemma's local layers), no more than that window. None where HF's own
    masks do exactly that (every token saw its document from its start)."""
    config = ref.text_config
    n = len(context_start)
    window = getattr(config, "sliding_window", None)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if "sliding_attention" not in layer_types and getattr(config, "model_type", "") in (
            "qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None
    if not np.any(context_start > 0):
        return None
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    seen = (k <= q) & (k >= np.asarray(context_start)[:, None])

    def additive(allowed):
        import torch

        values = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)
        return torch.as_tensor(values[None, None], device=ref.device)

    local = seen & ((q - k) < window) if window else seen
    if "sliding_attention" in layer_types and "full_attention" in layer_types:
        return {"full_attention": additive(seen), "sliding_attention": additive(local)}
    return additive(local)


def hooks(ref: HFReference, input_ids: np.ndarray, context_start: np.ndarray,
          wanted: list[str]) -> dict[str, np.ndarray]:
    """{hook: float32 [n, hidden]} for the `wanted` actx hooks of one document of ids
    `input_ids` [n] (positions 0..n-1), each token seeing what `context_start` says."""
    import torch

    captured: dict = {}
    handles = []
    layers = _layers(ref.model)
    for i, layer in enumerate(layers):
        post_mlp = getattr(layer, "post_feedforward_layernorm", None)
        post_attn = post_mlp is not None and layer.post_attention_layernorm
        # GPT-2 names its attention `attn`, GPT-NeoX `attention`.
        attention = (getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
                     or layer.attention)
        handles.append((post_attn or attention).register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(
                ("attn_out", i), out[0] if isinstance(out, tuple) else out)))
        handles.append((post_mlp or layer.mlp).register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(("mlp_out", i), out)))
        handles.append(layer.register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(
                ("resid_post", i), out[0] if isinstance(out, tuple) else out)))
    try:
        with torch.no_grad():
            out = ref.model(input_ids=torch.as_tensor(np.asarray(input_ids)[None],
                                                      dtype=torch.long, device=ref.device),
                            attention_mask=masks(ref, np.asarray(context_start)),
                            output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    hidden = out.hidden_states
    result = {}
    for name in wanted:
        if name == "embed":
            value = hidden[0]
        elif name == "final_norm":
            value = hidden[-1]
        else:
            _, index, point = name.split(".")
            i = int(index)
            pre = hidden[0] if i == 0 else captured[("resid_post", i - 1)]
            value = (pre if point == "resid_pre" else
                     pre + captured[("attn_out", i)] if point == "resid_mid" else
                     captured[(point, i)])
        result[name] = value[0].detach().float().cpu().numpy()
    return result


def supports(hook: str, num_layers: int) -> bool:
    """Whether `hook` is an actx hook name this reference computes."""
    if hook in ("embed", "final_norm"):
        return True
    parts = hook.split(".")
    return (len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit()
            and int(parts[1]) < num_layers
            and parts[2] in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"))
