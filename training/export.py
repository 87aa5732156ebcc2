"""A node's trained model out of its checkpoint: GPT-2 layout for ``transformers``, and samples.

Our dense presets (``micro``, ``tiny``, ``gpt-125m``) are GPT-2's architecture: learned
position embeddings, pre-norm blocks (LayerNorm ε 1e-5), one fused q/k/v projection split
in that order, a 4× MLP, a final LayerNorm and an output head tied to the token
embedding. Two differences are written into the config rather than the weights: our MLP
uses the exact GELU (``activation_function: "gelu"``; GPT-2's default is the tanh
approximation) and our vocabulary is the run's (bytes, or its BPE). GPT-2 stores its linear
layers as ``Conv1D`` (``x @ W + b``, W of shape (in, out)): our ``nn.Linear`` weights are
written transposed.

What ``export`` writes into a folder (``AutoModelForCausalLM.from_pretrained(folder)`` and
``AutoTokenizer.from_pretrained(folder)`` load it; transformers is not needed to write it):

    model.safetensors        GPT-2's tensor names (lm_head is tied: not stored)
    config.json              GPT2LMHeadModel, our shape
    generation_config.json   no end-of-text token (bytes have none): generation runs to max_length
    tokenizer.json           the run's BPE (training/tokenizer.py), or for bytes a byte-level
                             BPE with no merges: token id = the byte's value
    tokenizer_config.json    PreTrainedTokenizerFast, model_max_length = our context

The weights are the node's φ after its last outer step (θ = φ then), from a checkpoint of
a φ/Δ algorithm (noloco, diloco, local). Mixture-of-experts models have no GPT-2 layout
and ZO keeps its weights elsewhere: both are refused with a clear error (``ExportError``).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from training import checkpoint, corpus, data, validation
from training.finite import all_finite
from training.models import GPT, GPTConfig, configured
from training.tokenizer import Codec

# Checkpoints whose ``phi.k`` are every parameter of the model, in ``model.parameters()`` order.
PHI_ALGORITHMS = ("noloco", "diloco", "local")


class ExportError(Exception):
    """The checkpoint holds no model we can write out (with the reason)."""


@dataclass(frozen=True, slots=True)
class Trained:
    model: GPT
    model_name: str
    round: int
    """Outer rounds done when the checkpoint was saved."""
    data_path: str | None = None
    """The text the node trained on (None: the embedded corpus): its validation split
    measures the model."""
    val_rows: int | None = None
    """How many validation blocks the run's loss curve is measured on (the checkpoint's
    ``val_rows``; None in one written before it said)."""


def load_trained(path: Path) -> Trained:
    """The model in a node's checkpoint (training/checkpoint.py), weights = φ."""
    try:
        tensors, meta = checkpoint.load(path)
    except checkpoint.CheckpointError as exc:
        raise ExportError(f"cannot read {path}: {exc}") from exc
    fingerprint = meta.get("fingerprint")
    if not isinstance(fingerprint, dict) or not isinstance(fingerprint.get("model"), str):
        raise ExportError(f"{path} does not say which model it holds (not a training checkpoint of ours)")
    algorithm, name = fingerprint.get("algorithm"), fingerprint["model"]
    if algorithm not in PHI_ALGORITHMS:
        raise ExportError(f"exporting a {algorithm} run is not supported yet (only {', '.join(PHI_ALGORITHMS)})")
    overrides = fingerprint.get("model_overrides") or {}
    try:
        config = configured(name, overrides)
    except (ValueError, TypeError) as exc:
        raise ExportError(f"{path}: model {name!r} with {overrides}: {exc}") from exc
    if config.num_experts:
        raise ExportError(f"model {name!r} is a mixture of experts: transformers has no GPT-2 layout for it")
    model = GPT(config)
    params = list(model.parameters())
    with torch.no_grad():
        for k, param in enumerate(params):
            saved = tensors.get(f"phi.{k}")
            if saved is None or saved.shape != param.shape:
                raise ExportError(f"{path}: phi.{k} does not fit model {name!r}")
            param.copy_(saved)
    model.eval()
    round_index = meta.get("round")
    data_path = fingerprint.get("data_path")
    val_rows = meta.get("val_rows")
    return Trained(
        model,
        name,
        round_index if isinstance(round_index, int) else 0,
        data_path if isinstance(data_path, str) else None,
        val_rows if type(val_rows) is int and 0 < val_rows <= validation.FULL_MAX_ROWS else None,
    )


# ``average`` leaves out a replica whose validation loss is this far above the median: an
# honest NoLoCo replica is within a few percent of its peers; a broken or hostile one is not.
MAX_LOSS_OVER_MEDIAN = 1.5


@dataclass(frozen=True, slots=True)
class Member:
    """One replica's part in an average."""

    name: str
    round: int
    val_loss: float
    used: bool


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def validation_batches(
    data_path: str | None, codec: Codec, context_len: int, num_rows: int, *, batch_size: int = 8
) -> Batches:
    """``num_rows`` blocks of the run's validation split (the last blocks of its text, every
    node's), the ones its workers measure (training/validation.py), as batches."""
    text = corpus.read_corpus(None if data_path is None else Path(data_path))
    shard = data.make_shard(data.tokens_of(text, codec), context_len=context_len, node_index=0, num_nodes=1)
    return shard.val_batches(batch_size=batch_size, num_rows=num_rows)


@torch.no_grad()
def val_loss(model: GPT, batches: Batches) -> float:
    """The mean loss over the blocks of ``batches``, each block weighing alike."""
    model.eval()
    return sum(float(model.loss(x, y)) * len(x) for x, y in batches) / sum(len(x) for x, _ in batches)


def average(replicas: list[tuple[str, Trained]], codec: Codec | None = None) -> tuple[Trained, list[Member], float]:
    """The mean of NoLoCo replicas' weights (the swarm's model), how each replica fared on
    the validation blocks of the run's loss curve (the whole split, ``FULL_MAX_ROWS`` at
    most, for a checkpoint that does not say how many), and the mean's loss there. A
    replica that is not finite, or whose loss is more than ``MAX_LOSS_OVER_MEDIAN`` times
    the median, is left out (said in its ``Member``). The text is read and tokenized once
    for all of them."""
    if not replicas:
        raise ExportError("no replica to average")
    reference = replicas[0][1]
    num_rows = reference.val_rows or validation.FULL_MAX_ROWS
    batches = validation_batches(reference.data_path, codec or Codec(), reference.model.config.context_len, num_rows)
    losses = []
    for name, trained in replicas:
        if [p.shape for p in trained.model.parameters()] != [p.shape for p in reference.model.parameters()]:
            raise ExportError(f"{name}'s model is not {reference.model_name}")
        finite = all(all_finite(p) for p in trained.model.parameters())
        losses.append(val_loss(trained.model, batches) if finite else math.inf)
    median = sorted(losses)[(len(losses) - 1) // 2]
    members = [
        Member(name, trained.round, loss, math.isfinite(loss) and loss <= MAX_LOSS_OVER_MEDIAN * median)
        for (name, trained), loss in zip(replicas, losses, strict=True)
    ]
    used = [trained for (_, trained), member in zip(replicas, members, strict=True) if member.used]
    mean = GPT(reference.model.config)
    each = [list(t.model.parameters()) for t in used]
    with torch.no_grad():
        for k, param in enumerate(mean.parameters()):
            param.copy_(torch.stack([params[k] for params in each]).mean(dim=0))
    mean.eval()
    rounds = max(t.round for t in used)
    averaged = Trained(mean, reference.model_name, rounds, reference.data_path, reference.val_rows)
    return averaged, members, val_loss(mean, batches)


def gpt2_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under GPT-2's names (``Conv1D`` weights transposed)."""
    ours = {name: p.detach() for name, p in model.named_parameters()}
    out = {
        "transformer.wte.weight": ours["token_embed.weight"],
        "transformer.wpe.weight": ours["pos_embed.weight"],
        "transformer.ln_f.weight": ours["norm.weight"],
        "transformer.ln_f.bias": ours["norm.bias"],
    }
    linear = {"qkv": "attn.c_attn", "proj": "attn.c_proj", "mlp_in": "mlp.c_fc", "mlp_out": "mlp.c_proj"}
    norms = {"norm1": "ln_1", "norm2": "ln_2"}
    for i in range(model.config.num_layers):
        for ours_name, theirs in linear.items():
            out[f"transformer.h.{i}.{theirs}.weight"] = ours[f"blocks.{i}.{ours_name}.weight"].t()
            out[f"transformer.h.{i}.{theirs}.bias"] = ours[f"blocks.{i}.{ours_name}.bias"]
        for ours_name, theirs in norms.items():
            for kind in ("weight", "bias"):
                out[f"transformer.h.{i}.{theirs}.{kind}"] = ours[f"blocks.{i}.{ours_name}.{kind}"]
    return {name: t.to(torch.float32).contiguous().clone() for name, t in out.items()}


def gpt2_config(config: GPTConfig) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.context_len,
        "n_embd": config.embed_dim,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": 4 * config.embed_dim,
        "activation_function": "gelu",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte a printable character (the ByteLevel
    pre-tokenizer of ``tokenizers`` maps bytes through the same table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def byte_tokenizer() -> dict[str, Any]:
    """tokenizers' JSON for our byte vocabulary: id = byte value, exact on any text."""
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    alphabet = _bytes_to_unicode()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": level,
        "post_processor": None,
        "decoder": level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {alphabet[b]: b for b in range(256)},
            "merges": [],
        },
    }


def export(trained: Trained, out_dir: Path, codec: Codec | None = None) -> list[Path]:
    """Write ``trained`` into ``out_dir`` (created) for transformers, with the run's
    tokenizer (``codec``; bytes when None or a byte codec); the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = trained.model.config
    written = []
    weights = out_dir / "model.safetensors"
    save_file(gpt2_tensors(trained.model), str(weights), metadata={"format": "pt"})
    written.append(weights)
    files: dict[str, dict[str, Any]] = {
        "config.json": gpt2_config(config),
        "generation_config.json": {"bos_token_id": None, "eos_token_id": None, "max_length": config.context_len},
        "tokenizer.json": byte_tokenizer() if codec is None or codec.json is None else json.loads(codec.json),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": config.context_len,
            "clean_up_tokenization_spaces": False,
        },
    }
    for name, content in files.items():
        path = out_dir / name
        path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(path)
    return written


@torch.no_grad()
def sample(
    model: GPT,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    codec: Codec | None = None,
) -> str:
    """A continuation of ``prompt`` (its tokens in, text out; the same for the same seed).
    ``temperature`` 0 takes the most likely token each time. ``codec``: the run's
    tokenizer (bytes when None)."""
    codec = codec or Codec()
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(codec.encode(prompt.encode() or b"\n"), dtype=torch.long)  # nothing: a new line
    context = model.config.context_len
    new = []
    for _ in range(max_new_tokens):
        # Only the tokenizer's ids (gpt-125m's byte runs pad the model's vocabulary).
        logits = model(tokens[-context:].unsqueeze(0))[0, -1, : codec.vocab_size]
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                cutoff = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, -torch.inf)
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        new.append(token)
        tokens = torch.cat([tokens, torch.tensor([token])])
    return codec.decode(new)
