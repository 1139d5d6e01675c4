"""Train hyserve's default model: a small Qwen3.5 hybrid (Gated DeltaNet + gated attention, 3:1) with an MTP head.

Everything it needs exists offline on every machine:

* corpus: the Python standard library's own ``*.py`` files (``sysconfig.get_paths()["stdlib"]``, sorted; test
  directories and site-packages skipped), split by file into train and held-out by a hash of the relative path;
* tokenizer: byte-level BPE trained with ``tokenizers`` on the train split (Qwen3.5's pre-tokenizer pipeline, the
  special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` at the top of the id range, ChatML template);
* model: transformers' ``Qwen3_5ForCausalLM`` (real layer types, partial RoPE 0.25, tied embeddings) plus an MTP
  module trained jointly. The MTP math is exactly hyserve's (``hyserve/model/mtp.py``): for position i,
  ``x_i = fc([pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])`` (embedding first, ``h_i`` the
  post-final-norm hidden state), one full-attention ``Qwen3_5DecoderLayer`` at position i with a causal mask and the
  model's rotary embedding, ``mtp.norm``, then the shared ``lm_head``; it predicts ``t_{i+2}``. The loss is
  ``CE(next token) + mtp_weight * CE(token after next)``.

The export is a ``Qwen3_5ForConditionalGeneration``-form checkpoint (``model.language_model.*`` + ``mtp.*``, bf16)
with tokenizer files and generation_config.json, followed by an evidence run: the checkpoint is loaded with hyserve
and with transformers, their float32 logits are compared, and greedy samples are generated with hyserve. The
evidence goes to ``training_report.json`` and ``TRAINING.md`` next to the checkpoint; ``heldout_prompts.json``
(prompts cut from held-out files) is written there too for ``measure_acceptance.py`` and the tests.

CPU (what ships in the repository until the H200 run; ~7 minutes on one thread, all included):

    python training/train_default_model.py --device cpu --preset cpu --max-minutes 6.5

H200 (the real run):

    python training/train_default_model.py --device cuda --preset h200 --max-minutes 7.5 --threads 8 --max-shard-mb 15

Training uses transformers' PyTorch Gated DeltaNet (fla-core is hidden from this process even where it is
installed): fla-core 0.6.0 refuses the backward of its gated chunk kernel on Hopper GPUs with Triton >= 3.4 and
< 3.7.1, because that combination computes wrong gradients (fla issue #640). ``--fla`` uses fla's kernels where
that does not apply (another GPU, or Triton >= 3.7.1).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

EVIDENCE_FLAG = "--evidence-to"
FLA_FLAG = "--fla"
if EVIDENCE_FLAG in sys.argv or FLA_FLAG not in sys.argv:
    # transformers binds its Gated DeltaNet functions to fla-core's Triton kernels when fla is importable. Those
    # cannot run the float32 CPU reference (the evidence subprocess, see run_evidence), and their gated backward is
    # refused on Hopper with Triton 3.4-3.7.0 (see the module docstring). Hide fla before transformers is imported,
    # so its PyTorch path is used, unless --fla asks for fla.
    sys.modules["fla"] = None  # type: ignore[assignment]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from hyserve.testing import (  # noqa: E402
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
    mtp_shapes,
    tokenizer_config,
    train_bpe,
)

DEFAULT_OUT = os.path.join(_REPO, "hyserve", "default_model")
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
SAMPLE_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.",
    "    for i in range(len(",
    "def __repr__(self):\n        return ",
    'if __name__ == "__main__":\n',
)
REPORT_JSON = "training_report.json"
REPORT_MD = "TRAINING.md"
PROMPTS_JSON = "heldout_prompts.json"
ACCEPTANCE_BEGIN = "<!-- acceptance:begin -->"
ACCEPTANCE_END = "<!-- acceptance:end -->"


# --------------------------------------------------------------------------------------------------- arguments

PRESETS: dict[str, dict[str, Any]] = {
    # The H200 default: 8 layers [lin, lin, lin, full] x 2, hidden 256; ~10M parameters (~21 MB in bf16 with MTP).
    "h200": dict(hidden_size=256, intermediate_size=768, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=64,
                 linear_key_heads=4, linear_value_heads=8, linear_head_dim=64, seq_len=512, batch_size=64,
                 lr=2e-3, warmup_steps=200, eval_every=250, eval_windows=256, vocab_size=4096,
                 # ~2.8-3.4M train tokens at vocab 4096 (by Python version). A first H200 run over 60M tokens
                 # (~21 epochs) had its lowest held-out loss at 16M tokens and overfit after: 20M ends the schedule
                 # about there.
                 max_tokens=20_000_000),
    # One CPU thread for a few minutes: 4 layers [lin, lin, lin, full], hidden 128, vocab 2048 (the logits are most
    # of the cost at this size), short sequences.
    "cpu": dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                linear_key_heads=2, linear_value_heads=4, linear_head_dim=32, seq_len=128, batch_size=16,
                lr=3e-3, warmup_steps=30, eval_every=100, eval_windows=48, vocab_size=2048, max_tokens=0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="checkpoint directory (default: hyserve/default_model)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda if available)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="h200",
                   help="model/batch shape preset; any flag below overrides it (default h200)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="bf16: bf16 autocast over float32 weights; auto: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch and tokenizers (default 1)")
    p.add_argument(FLA_FLAG, action="store_true",
                   help="train with fla-core's Gated DeltaNet kernels (not on Hopper with Triton < 3.7.1)")
    p.add_argument("--seed", type=int, default=0)
    # corpus and tokenizer
    p.add_argument("--max-corpus-bytes", type=int, default=0, help="cap on corpus bytes (0: the whole stdlib)")
    p.add_argument("--heldout-percent", type=float, default=5.0)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="tokenizer size including the 3 special tokens (h200 preset 4096, cpu preset 2048)")
    # model (None: the preset's value)
    for name in ("hidden-size", "intermediate-size", "num-layers", "num-heads", "num-kv-heads", "head-dim",
                 "linear-key-heads", "linear-value-heads", "linear-head-dim"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    # optimisation
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of the peak")
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="lambda in CE(next) + lambda * CE(after next)")
    # budgets
    p.add_argument("--max-minutes", type=float, default=9.0,
                   help="time budget of the training loop (evaluations included); 0: none (default 9)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="token budget, 0: none (h200 preset 20M, whichever of time and tokens ends first)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="exact number of optimizer steps (0: derived from the budgets). With a time budget the "
                        "step count is calibrated after --calibration-steps steps; pass the reported step count "
                        "here (and --max-minutes 0) to reproduce a run exactly")
    p.add_argument("--schedule-steps", type=int, default=0,
                   help="length of the lr schedule in steps (0: the step count); with --max-steps, reproduces a "
                        "run that the time budget stopped early")
    p.add_argument("--calibration-steps", type=int, default=20,
                   help="steps timed before the step count is fixed (at most --warmup-steps, so the lr of the "
                        "calibration steps does not depend on the count)")
    p.add_argument("--eval-every", type=int, default=None, help="held-out evaluation every N steps")
    p.add_argument("--eval-windows", type=int, default=None, help="held-out windows of seq_len tokens per evaluation")
    p.add_argument("--num-prompts", type=int, default=16, help="held-out prompts written for acceptance tests")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--no-keep-best", action="store_true",
                   help="export the final weights even if an earlier evaluation had a lower held-out loss")
    p.add_argument("--max-shard-mb", type=float, default=0,
                   help="split the weights into shards of at most this many MiB (0: one file)")
    p.add_argument(EVIDENCE_FLAG, default=None, help=argparse.SUPPRESS)  # internal: run_evidence's subprocess
    p.add_argument("--skip-evidence", action="store_true", help="do not run the hyserve/transformers checks")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# --------------------------------------------------------------------------------------------------- corpus


@dataclasses.dataclass
class Corpus:
    root: str
    train: list[tuple[str, str]]  # (relative path, text)
    heldout: list[tuple[str, str]]
    skipped_undecodable: int

    def nbytes(self, split: str) -> int:
        docs = self.train if split == "train" else self.heldout
        return sum(len(t.encode("utf-8")) for _, t in docs)


def is_heldout(rel: str, percent: float) -> bool:
    h = int(hashlib.sha1(rel.encode("utf-8")).hexdigest()[:8], 16)
    return (h % 10000) < percent * 100


def collect_corpus(max_bytes: int, heldout_percent: float) -> Corpus:
    """The stdlib's ``*.py`` files, sorted by relative path; with ``max_bytes`` a hash-ordered subset (so the cap
    does not keep only the alphabetically first packages), then sorted again."""
    root = sysconfig.get_paths()["stdlib"]
    paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        paths.extend(os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py"))
    paths.sort()
    docs: list[tuple[str, str]] = []
    skipped = 0
    for rel in paths:
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            skipped += 1
            continue
        if text.strip():
            docs.append((rel.replace(os.sep, "/"), text))
    if max_bytes > 0:
        order = sorted(docs, key=lambda d: hashlib.sha1(d[0].encode("utf-8")).hexdigest())
        kept: list[tuple[str, str]] = []
        total = 0
        for d in order:
            n = len(d[1].encode("utf-8"))
            if total + n > max_bytes:
                continue
            kept.append(d)
            total += n
        docs = sorted(kept)
    train = [d for d in docs if not is_heldout(d[0], heldout_percent)]
    heldout = [d for d in docs if is_heldout(d[0], heldout_percent)]
    return Corpus(root=root, train=train, heldout=heldout, skipped_undecodable=skipped)


# --------------------------------------------------------------------------------------------------- tokenizer


def encode_docs(tok: Any, docs: list[tuple[str, str]], eot: int) -> torch.Tensor:
    """One token stream: every document followed by ``<|endoftext|>``."""
    encs = tok.encode_batch([t for _, t in docs], add_special_tokens=False)
    ids: list[int] = []
    for e in encs:
        ids.extend(e.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------------------------------- model


def make_text_config(args: argparse.Namespace, vocab_size: int, eos_id: int) -> Any:
    from transformers import Qwen3_5TextConfig

    n = args.num_layers
    if n % 4:
        raise ValueError(f"--num-layers must be a multiple of 4 (3 GDN : 1 attention), got {n}")
    layer_types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(n)]
    prf = 0.25
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=n,
        layer_types=layer_types,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        linear_num_key_heads=args.linear_key_heads,
        linear_key_head_dim=args.linear_head_dim,
        linear_num_value_heads=args.linear_value_heads,
        linear_value_head_dim=args.linear_head_dim,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": prf},
        partial_rotary_factor=prf,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=None,
        attention_dropout=0.0,
    )


class MTPModule(nn.Module):
    """Qwen3.5's MTP head for training; parameter names are the checkpoint's ``mtp.*`` names minus the prefix."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        h, eps = config.hidden_size, config.rms_norm_eps
        layer_cfg = copy.deepcopy(config)
        layer_cfg.layer_types = ["full_attention"]
        layer_cfg.num_hidden_layers = 1
        self.layer_config = layer_cfg
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_cfg, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)
        std = config.initializer_range
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                nn.init.normal_(p, std=std)
            elif name.endswith("weight"):
                nn.init.zeros_(p)  # zero-centred RMSNorms: gain (1 + w)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, rotary: nn.Module) -> torch.Tensor:
        """``next_embeds[:, i]`` = embed(t_{i+1}), ``hidden[:, i]`` = h_i; returns mtp.norm(layer(fc(...)))."""
        from transformers.masking_utils import create_causal_mask

        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device).unsqueeze(0).expand(b, -1)
        position_embeddings = rotary(x, pos[None].expand(3, b, t))  # text positions on all three mrope axes
        mask = create_causal_mask(config=self.layer_config, inputs_embeds=x, attention_mask=None,
                                  past_key_values=None, position_ids=pos)
        y = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask, position_ids=pos)
        return self.norm(y)


class ModelWithMTP(nn.Module):
    """transformers' ``Qwen3_5ForCausalLM`` (``lm``) and the MTP head (``mtp``), which shares its embedding, rotary
    embedding and ``lm_head``."""

    def __init__(self, config: Any, lm: nn.Module | None = None) -> None:
        super().__init__()
        from transformers import Qwen3_5ForCausalLM

        self.lm = lm if lm is not None else Qwen3_5ForCausalLM(config)
        assert self.lm.lm_head.weight is self.lm.model.embed_tokens.weight, "embeddings are not tied"
        self.mtp = MTPModule(self.lm.config)  # the model's config: it carries the attention implementation

    def logits(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) tokens -> main logits (B, T, V) for t_{i+1}, MTP logits (B, T - 1, V) for t_{i+2}."""
        body = self.lm.model
        h = body(input_ids=ids, use_cache=False).last_hidden_state  # post-final-norm, (B, T, H)
        y = self.mtp(body.embed_tokens(ids[:, 1:]), h[:, :-1], body.rotary_emb)  # positions 0 .. T-2
        return self.lm.lm_head(h), self.lm.lm_head(y)

    def losses(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean CE of the next token and of the token after next (MTP) over a (B, T) batch."""
        main, mtp = self.logits(ids[:, :-1])  # the MTP head at position T-2 would need t_T: not computed
        vocab = main.shape[-1]
        loss_main = F.cross_entropy(main.float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss_mtp = F.cross_entropy(mtp.float().reshape(-1, vocab), ids[:, 2:].reshape(-1))
        return loss_main, loss_mtp


def load_model_with_mtp(path: str) -> ModelWithMTP:
    """A written checkpoint as a float32 ``ModelWithMTP`` (transformers loads the text model; ``mtp.*`` here)."""
    from safetensors import safe_open
    from transformers import Qwen3_5ForCausalLM

    lm = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    model = ModelWithMTP(lm.config, lm=lm)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if key.startswith("mtp."):
                        state[key[len("mtp."):]] = f.get_tensor(key).float()
    model.mtp.load_state_dict(state, strict=True)
    return model.eval()


def export_tensors(model: ModelWithMTP, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint tensors in the ConditionalGeneration form: ``model.language_model.*`` (no lm_head: tied)
    and ``mtp.*``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.lm.state_dict().items():
        if name == "lm_head.weight":
            continue
        assert name.startswith("model."), name
        out["model.language_model." + name[len("model."):]] = t.detach().to("cpu", dtype).contiguous()
    for name, t in model.mtp.state_dict().items():
        out["mtp." + name] = t.detach().to("cpu", dtype).contiguous()
    expected = mtp_shapes(model.lm.config)
    got = {k: tuple(v.shape) for k, v in out.items() if k.startswith("mtp.")}
    if got != expected:
        raise AssertionError(f"MTP tensors differ from hyserve.testing.mtp_shapes: {sorted(set(got) ^ set(expected))}")
    return out


# --------------------------------------------------------------------------------------------------- data


class Batches:
    """Random windows of ``seq_len + 1`` tokens of the train stream, from a seeded generator."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        self.stream = stream
        self.n = seq_len + 1
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[torch.Tensor]:
        offsets = torch.arange(self.n)
        while True:
            starts = torch.randint(0, len(self.stream) - self.n + 1, (self.batch_size,), generator=self.gen)
            yield self.stream[starts[:, None] + offsets]


def eval_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len + 1`` tokens spread evenly over the held-out stream."""
    n = seq_len + 1
    total = len(stream) // n
    if total == 0:
        raise ValueError("held-out split is shorter than one window")
    picks = torch.linspace(0, total - 1, steps=min(count, total)).round().long()
    return torch.stack([stream[i * n:(i + 1) * n] for i in picks.tolist()])


@torch.no_grad()
def evaluate(model: ModelWithMTP, windows: torch.Tensor, device: torch.device, batch_size: int,
             autocast: bool) -> tuple[float, float]:
    was_training = model.training
    model.eval()
    tot_main = tot_mtp = 0.0
    n = 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            lm, lt = model.losses(batch)
        tot_main += float(lm) * len(batch)
        tot_mtp += float(lt) * len(batch)
        n += len(batch)
    model.train(was_training)
    return tot_main / n, tot_mtp / n


def unigram_baseline(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Held-out cross-entropy (nats/token) of the add-one-smoothed train unigram distribution."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[heldout].mean())


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# --------------------------------------------------------------------------------------------------- export


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def config_json(config: Any) -> dict[str, Any]:
    """config.json in Qwen3.5's published form: ``qwen3_5`` with ``text_config`` and MTP fields."""
    text = config.to_diff_dict()
    text.pop("transformers_version", None)
    text["model_type"] = "qwen3_5_text"
    text["dtype"] = "bfloat16"
    text["layer_types"] = list(config.layer_types)
    text["tie_word_embeddings"] = True
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
    }


def write_checkpoint(out: str, model: ModelWithMTP, tok: Any, ids: dict[str, int], max_len: int,
                     max_shard_bytes: int = 0) -> None:
    """Weights (one ``model.safetensors``, or shards + index when over ``max_shard_bytes``), config.json,
    generation_config.json and the tokenizer files. Earlier weights and acceptance results in ``out`` are removed."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name.endswith(".safetensors") or name in ("model.safetensors.index.json", "acceptance_report.json"):
            os.remove(os.path.join(out, name))
    tensors = export_tensors(model)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if max_shard_bytes and total > max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for fname, part in zip(files, shards, strict=True):
        save_file(part, os.path.join(out, fname), metadata={"format": "pt"})
        os.chmod(os.path.join(out, fname), 0o644)  # safetensors writes 0600; the files ship as package data
    if len(shards) > 1:
        weight_map = {n: f for f, part in zip(files, shards, strict=True) for n in part}
        _write_json(os.path.join(out, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(os.path.join(out, "config.json"), config_json(model.lm.config))
    _write_json(os.path.join(out, "generation_config.json"), {
        "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT], "do_sample": False,
        # The model rarely ends a turn itself: a default cap keeps a request without max_tokens short.
        "max_new_tokens": 256,
    })
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok.to_str())
    _write_json(os.path.join(out, "tokenizer_config.json"), tokenizer_config(ids, max_len))


def heldout_prompts(tok: Any, docs: list[tuple[str, str]], count: int, n_tokens: int) -> list[dict[str, Any]]:
    """Prompts of ``n_tokens`` tokens cut from held-out files at line starts (evenly spaced over the files)."""
    prompts: list[dict[str, Any]] = []
    if not docs:
        return prompts
    step = max(1, len(docs) // count)
    for rel, text in docs[::step][:count]:
        lines = text.splitlines(keepends=True)
        # Start a quarter into the file, at a line that is not blank: skips the licence/docstring preamble.
        start = len(lines) // 4
        while start < len(lines) - 1 and not lines[start].strip():
            start += 1
        body = "".join(lines[start:])
        ids = tok.encode(body, add_special_tokens=False).ids[:n_tokens]
        if len(ids) < n_tokens // 2:
            continue
        prompts.append({"source": rel, "prompt": tok.decode(ids, skip_special_tokens=False),
                        "prompt_token_ids": ids})
    return prompts


# --------------------------------------------------------------------------------------------------- evidence


def hyserve_logits(llm: Any, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Teacher-forced float32 logits of hyserve's serving path over ``token_ids`` (one prefill step).

    Forward hooks record the post-norm hidden state of every prompt position (the runner's model) and, when the
    engine runs MTP speculation, the MTP head's output at every position of its first pass; the model's own
    ``compute_logits`` turns them into logits. Returns ``(main (L, V), mtp (L, V) or None, first sampled token)``:
    main row i predicts token i+1; MTP row i takes (token i+1, h_i) and predicts token i+2, where token L is the
    sampled one. Needs prefix caching off and a token budget that fits the prompt in one step."""
    from hyserve import SamplingParams

    runner = llm.llm_engine.runner
    seen: list[torch.Tensor] = []
    seen_mtp: list[torch.Tensor] = []
    hooks = [runner.model.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))]
    if runner.mtp is not None:
        hooks.append(runner.mtp.register_forward_hook(lambda _m, _i, out: seen_mtp.append(out.detach())))
    try:
        outs = llm.generate([{"prompt_token_ids": list(token_ids)}], SamplingParams(temperature=0.0, max_tokens=2),
                            use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    n = len(token_ids)
    assert seen[0].shape[0] == n, "the prompt did not run in one step"
    with torch.no_grad():
        main = runner.model.compute_logits(seen[0]).float().cpu()
        mtp = None
        if seen_mtp:
            assert seen_mtp[0].shape[0] == n, f"the first MTP pass covered {seen_mtp[0].shape[0]} of {n} positions"
            mtp = runner.model.compute_logits(seen_mtp[0]).float().cpu()
    return main, mtp, int(outs[0].outputs[0].token_ids[0])


def crosscheck(out: str, token_lists: list[list[int]]) -> dict[str, Any]:
    """Max |logit| differences between hyserve and the training-time model (both float32, CPU), teacher forced:
    the main model against transformers' ``Qwen3_5ForCausalLM``, and hyserve's MTP head against the MTP forward this
    script trains (``ModelWithMTP``, its text model transformers' own)."""
    from hyserve import LLM

    llm = LLM(model=out, device="cpu", dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=4096,
              max_num_seqs=4, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    ref = load_model_with_mtp(out)
    diffs: list[float] = []
    mtp_diffs: list[float] = []
    scale = 0.0
    for ids in token_lists:
        got, got_mtp, sampled = hyserve_logits(llm, ids)
        with torch.no_grad():
            want, want_mtp = ref.logits(torch.tensor([[*ids, sampled]]))
        diffs.append(float((got - want[0, :-1]).abs().max()))
        assert got_mtp is not None
        mtp_diffs.append(float((got_mtp - want_mtp[0]).abs().max()))
        scale = max(scale, float(want.abs().max()), float(want_mtp.abs().max()))
    return {"prompts": len(token_lists), "tokens": [len(t) for t in token_lists], "max_abs_logit_diff": diffs,
            "max": max(diffs), "mtp_max_abs_logit_diff": mtp_diffs, "mtp_max": max(mtp_diffs), "logit_scale": scale}


def samples(out: str, prompts: tuple[str, ...], max_tokens: int) -> list[dict[str, str]]:
    from hyserve import LLM, SamplingParams

    llm = LLM(model=out, device="cpu", dtype="float32", max_num_seqs=8)
    outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [{"prompt": p, "completion": o.outputs[0].text, "finish_reason": str(o.outputs[0].finish_reason)}
            for p, o in zip(prompts, outs, strict=True)]


def evidence(out: str) -> dict[str, Any]:
    """The float32 CPU checks of a written checkpoint: hyserve vs transformers / the training-time MTP forward on
    the first held-out prompts (each followed by a sample prompt), and greedy hyserve samples."""
    from tokenizers import Tokenizer

    with open(os.path.join(out, PROMPTS_JSON), encoding="utf-8") as f:
        prompts = json.load(f)["prompts"]
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    check_ids = [p["prompt_token_ids"] + tok.encode(SAMPLE_PROMPTS[i], add_special_tokens=False).ids
                 for i, p in enumerate(prompts[:4])]
    return {"crosscheck": crosscheck(out, check_ids), "samples": samples(out, SAMPLE_PROMPTS, 48)}


def run_evidence(out: str, threads: int) -> dict[str, Any]:
    """``evidence`` in this process, or in a subprocess with fla-core hidden when it is importable (CUDA machines)."""
    import importlib.util

    torch.set_num_threads(threads)
    if importlib.util.find_spec("fla") is None:
        return evidence(out)
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "evidence.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--out", out, "--threads", str(threads),
                        EVIDENCE_FLAG, path], check=True)
        with open(path, encoding="utf-8") as f:
            result: dict[str, Any] = json.load(f)
    return result


def dir_size(path: str) -> dict[str, int]:
    return {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))
            if os.path.isfile(os.path.join(path, f))}


def write_markdown(out: str, report: dict[str, Any]) -> None:
    r = report
    m, t, c, ev = r["model"], r["training"], r["corpus"], r["heldout"]
    md_path = os.path.join(out, REPORT_MD)
    lines = [
        "# hyserve default model",
        "",
        f"A {m['params_total'] / 1e6:.2f}M-parameter Qwen3.5 hybrid ({m['num_layers']} layers: "
        f"{', '.join(x.replace('_attention', '') for x in m['layer_types'])}; hidden {m['hidden_size']}, "
        f"vocab {m['vocab_size']}, tied embeddings, partial RoPE 0.25) with one MTP layer "
        f"({m['params_mtp'] / 1e6:.2f}M parameters), trained on the Python standard library's source. "
        f"Written by `training/train_default_model.py`; every number below is from `{REPORT_JSON}`.",
        "",
    ]
    if t["device"] == "cpu":
        lines += [
            "**This checkpoint was trained on a CPU (one thread, about 7 minutes in all) with the small `cpu` "
            "preset.** It is weak: it has learned the surface of Python (indentation, keywords, common identifiers, "
            "docstrings, `self._x = ...`), not programs, and its greedy output repeats itself. It exists so that "
            "`LLM()` and `hyserve serve` have a real, non-random default that exercises the whole engine, MTP "
            "speculation included. The intended model comes from the H200 run below (the `h200` preset: 8 layers, "
            "hidden 256, vocab 4096, ~10M parameters, ~21 MB in bf16).",
            "",
        ]
    lines += [
        "## Reproduce",
        "",
        "```bash",
        r["command"],
        "```",
        "",
        f"Exactly this run (same steps and lr schedule, no time budget; float32 on the CPU is deterministic, "
        f"bf16 on CUDA need not be): `{r['reproduce_command']}`.",
        "",
    ]
    if t["device"] == "cpu":
        lines += [
            "The H200 run (bf16 autocast over float32 weights; at most 7.5 minutes or 20M tokens of training, then "
            "export and the float32 CPU checks):",
            "",
            "```bash",
            "python training/train_default_model.py --device cuda --preset h200 --max-minutes 7.5 --threads 8 "
            "--max-shard-mb 15",
            "python training/measure_acceptance.py",
            "```",
            "",
        ]
    lines += [
        "Training runs transformers' PyTorch Gated DeltaNet, with fla-core hidden from the process: fla-core "
        "0.6.0 refuses its gated chunk backward on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (wrong gradients, "
        "fla issue #640); `--fla` uses fla's kernels where that does not apply. "
        "`tests/model/test_default_model.py` checks the checkpoint in the CPU suite (`bash scripts/test.sh`; not "
        "on a machine with fla-core, whose kernels transformers would use for its CPU reference).",
        "",
        "## Corpus and tokenizer",
        "",
        f"- Python {c['python_version']} standard library (`{c['stdlib']}`), `*.py`, test directories and "
        f"site-packages skipped: {c['train_files']} train files ({c['train_bytes']:,} bytes, "
        f"{c['train_tokens']:,} tokens), {c['heldout_files']} held-out files ({c['heldout_bytes']:,} bytes, "
        f"{c['heldout_tokens']:,} tokens); split by a hash of the relative path ({c['heldout_percent']} % held out).",
        f"- Byte-level BPE, {r['tokenizer']['vocab_size']} tokens including `<|endoftext|>`, `<|im_start|>`, "
        f"`<|im_end|>` (ids {r['tokenizer']['special_ids']}); {c['train_bytes'] / c['train_tokens']:.2f} bytes "
        "per token on the train split. ChatML chat template; eos `<|im_end|>` and `<|endoftext|>`.",
        "",
        "## Training",
        "",
        f"- Device: {t['device']} ({t['device_name']}), {t['precision']}, {t['threads']} CPU thread(s).",
        f"- {t['steps']} steps x {t['batch_size']} x {t['seq_len']} tokens = {t['tokens_seen']:,} tokens seen "
        f"({t['epochs']:.2f} epochs of the train split) in {t['train_wall_s']:.0f} s "
        f"({t['tokens_per_s']:,.0f} tokens/s); whole script {r['total_wall_s']:.0f} s.",
        f"- AdamW (0.9, 0.95), peak lr {t['lr']}, {t['warmup_steps']} warmup steps, cosine to "
        f"{t['min_lr_ratio']} x peak, weight decay {t['weight_decay']}, grad clip {t['grad_clip']}, "
        f"MTP loss weight {t['mtp_weight']}, seed {t['seed']}. Exported: {t['exported_step_note']}.",
        "",
        "## Held-out loss (exported bf16 weights)",
        "",
        "| | loss (nats/token) | perplexity |",
        "| --- | --- | --- |",
        f"| next token (main model) | {ev['loss']:.4f} | {ev['perplexity']:.2f} |",
        f"| token after next (MTP head) | {ev['mtp_loss']:.4f} | {math.exp(ev['mtp_loss']):.2f} |",
        f"| unigram baseline (train unigram, add-one) | {ev['unigram_loss']:.4f} | "
        f"{math.exp(ev['unigram_loss']):.2f} |",
        "",
        f"Measured on {ev['windows']} held-out windows of {t['seq_len']} tokens.",
        "",
        "Evaluation history (step: held-out main / MTP loss): "
        + ", ".join(f"{e['step']}: {e['loss']:.3f} / {e['mtp_loss']:.3f}" for e in r["eval_history"]) + ".",
        "",
    ]
    cc = r.get("crosscheck")
    if cc:
        lines += [
            "## hyserve vs transformers",
            "",
            f"Teacher-forced float32 logits on the CPU over {cc['prompts']} held-out prompts ({cc['tokens']} "
            f"tokens): max |hyserve - transformers| = {cc['max']:.2e} (logits up to {cc['logit_scale']:.1f}); "
            f"per prompt {[f'{d:.1e}' for d in cc['max_abs_logit_diff']]}. The MTP head in hyserve against the MTP "
            f"forward this script trains (same prompts, every position): max {cc['mtp_max']:.2e}.",
            "",
        ]
    if r.get("samples"):
        lines += ["## Greedy samples (hyserve, float32 CPU)", ""]
        for s in r["samples"]:
            lines += ["```python", s["prompt"] + s["completion"], "```", ""]
    lines += [
        "## MTP acceptance (hyserve)",
        "",
        ACCEPTANCE_BEGIN,
        "Not measured yet: run `python training/measure_acceptance.py`.",
        ACCEPTANCE_END,
        "",
        "## Files",
        "",
        "| file | bytes |",
        "| --- | --- |",
    ]
    lines += [f"| `{f}` | {n:,} |" for f, n in r["files"].items()]
    lines.append("")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


# --------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.evidence_to:
        torch.set_num_threads(args.threads)
        _write_json(args.evidence_to, evidence(os.path.abspath(args.out)))
        return {}
    t_start = time.perf_counter()
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false" if args.threads == 1 else "true")
    torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    use_autocast = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    corpus = collect_corpus(args.max_corpus_bytes, args.heldout_percent)
    log(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out files, "
        f"{corpus.nbytes('train'):,} / {corpus.nbytes('heldout'):,} bytes")
    tok = train_bpe([t for _, t in corpus.train], args.vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    train_stream = encode_docs(tok, corpus.train, ids[ENDOFTEXT])
    heldout_stream = encode_docs(tok, corpus.heldout, ids[ENDOFTEXT])
    log(f"tokenizer: {n_tok} tokens; train {len(train_stream):,} tokens, held-out {len(heldout_stream):,} tokens")
    vocab = n_tok  # the tokenizer's size exactly (4096 by default: a multiple of 64 already)

    torch.manual_seed(args.seed)
    config = make_text_config(args, vocab, ids[ENDOFTEXT])
    model = ModelWithMTP(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in model.mtp.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters ({n_mtp / 1e6:.2f}M MTP), layers {config.layer_types}")

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    tokens_per_step = args.batch_size * args.seq_len
    windows = eval_windows(heldout_stream, args.seq_len, args.eval_windows)
    unigram = unigram_baseline(train_stream, heldout_stream, vocab)
    log(f"unigram baseline on held-out: {unigram:.4f} nats/token (ppl {math.exp(unigram):.1f})")

    budget_s = args.max_minutes * 60.0
    args.calibration_steps = max(1, min(args.calibration_steps, args.warmup_steps))
    total = args.max_steps or 0
    if not total and args.max_tokens:
        total = max(1, args.max_tokens // tokens_per_step)
    if not total and budget_s <= 0:
        raise SystemExit("give a budget: --max-steps, --max-tokens or --max-minutes")
    calibrated = bool(total) and not (budget_s > 0 and not args.max_steps)
    provisional = total or 10**9

    batches = iter(Batches(train_stream, args.seq_len, args.batch_size, args.seed))
    history: list[dict[str, float]] = []
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run_eval(step: int) -> None:
        nonlocal eval_s, best
        t0 = time.perf_counter()
        ev_main, ev_mtp = evaluate(model, windows, device, args.batch_size, use_autocast)
        eval_s += time.perf_counter() - t0
        history.append({"step": step, "tokens": step * tokens_per_step, "loss": ev_main, "mtp_loss": ev_mtp,
                        "seconds": time.perf_counter() - t_train})
        log(f"eval step {step}: held-out loss {ev_main:.4f} (ppl {math.exp(ev_main):.2f}) mtp {ev_mtp:.4f}")
        if not args.no_keep_best and (best is None or ev_main < best[0]):
            best = (ev_main, step, {k: v.detach().clone() for k, v in model.state_dict().items()})

    schedule = args.schedule_steps or total
    warm_step = min(5, args.calibration_steps // 2)  # the first steps (allocations, autotuning) are not timed
    t_train = time.perf_counter()
    t_warm = t_train
    step = 0
    last_log = t_train
    run_main = torch.zeros((), device=device)
    run_mtp = torch.zeros((), device=device)
    run_n = 0
    eval_s = 0.0
    while True:
        horizon = total if calibrated else provisional
        if step >= horizon:
            break
        if budget_s > 0 and time.perf_counter() - t_train >= budget_s:
            log(f"time budget reached at step {step} (of {horizon})")
            break
        schedule = args.schedule_steps or horizon
        lr = lr_at(step, schedule, args.warmup_steps, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = next(batches).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            loss_main, loss_mtp = model.losses(batch)
            loss = loss_main + args.mtp_weight * loss_mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        run_main += loss_main.detach()
        run_mtp += loss_mtp.detach()
        run_n += 1
        if step == warm_step:
            sync()
            t_warm = time.perf_counter()
        if not calibrated and step == args.calibration_steps:
            sync()
            now = time.perf_counter()
            per_step = (now - t_warm) / (step - warm_step)
            # Reserve time for the evaluations still to come (forward only: ~1/3 of a training step per window).
            left = budget_s - (now - t_train)
            n_evals = 1 + int(left / per_step) // args.eval_every
            eval_cost = per_step * math.ceil(len(windows) / args.batch_size) / 3
            total = step + max(1, int((left - n_evals * eval_cost) / per_step * 0.98))
            if args.max_tokens:
                total = min(total, max(step + 1, args.max_tokens // tokens_per_step))
            calibrated = True
            log(f"calibrated: {per_step:.3f} s/step -> {total} steps ({total * tokens_per_step:,} tokens)")
        now = time.perf_counter()
        if now - last_log > 30 or step == 1:
            log(f"step {step}: loss {run_main.item() / run_n:.4f} mtp {run_mtp.item() / run_n:.4f} lr {lr:.2e} "
                f"({tokens_per_step * step / (now - t_train - eval_s):,.0f} tok/s)")
            run_main.zero_()
            run_mtp.zero_()
            run_n = 0
            last_log = now
        if step % args.eval_every == 0 or (calibrated and step >= total):
            run_eval(step)
    if not history or history[-1]["step"] != step:
        run_eval(step)  # stopped by the time budget: the last weights are evaluated too
    sync()
    train_wall = time.perf_counter() - t_train

    exported_step = step
    if best is not None and best[1] != step:
        model.load_state_dict(best[2])
        exported_step = best[1]
    note = f"step {exported_step}" + (" (lowest held-out loss; the last step was worse)" if exported_step != step
                                      else " (the last step)")
    # Round to bf16 (what is stored), then measure the held-out loss of exactly what ships, in float32.
    model = model.float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    final_main, final_mtp = evaluate(model, windows, device, args.batch_size, autocast=False)
    log(f"exported weights (bf16): held-out loss {final_main:.4f} (ppl {math.exp(final_main):.2f}), "
        f"mtp {final_mtp:.4f}; unigram {unigram:.4f}")

    out = os.path.abspath(args.out)
    model = model.cpu()
    write_checkpoint(out, model, tok, ids, max_len=4096, max_shard_bytes=int(args.max_shard_mb * 1024 * 1024))
    prompts = heldout_prompts(tok, corpus.heldout, args.num_prompts, args.prompt_tokens)
    _write_json(os.path.join(out, PROMPTS_JSON), {
        "note": "prompts cut from held-out stdlib files (never trained on); used by training/measure_acceptance.py "
                "and tests/model/test_default_model.py",
        "prompts": prompts,
    })
    log(f"wrote {out}")

    given = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python training/train_default_model.py", *given])
    budget_flags = ("--max-minutes", "--max-steps", "--schedule-steps")
    kept = [a for i, a in enumerate(given)
            if not a.startswith(budget_flags) and not (i > 0 and given[i - 1] in budget_flags)]
    report: dict[str, Any] = {
        "command": command,
        "reproduce_command": " ".join(["python training/train_default_model.py", *kept, "--max-minutes 0",
                                       f"--max-steps {step} --schedule-steps {schedule}"]),
        "corpus": {
            "python_version": platform.python_version(), "stdlib": corpus.root,
            "skipped_dirs": sorted(SKIP_DIRS), "heldout_percent": args.heldout_percent,
            "train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
            "train_bytes": corpus.nbytes("train"), "heldout_bytes": corpus.nbytes("heldout"),
            "train_tokens": len(train_stream), "heldout_tokens": len(heldout_stream),
            "skipped_undecodable": corpus.skipped_undecodable,
            "heldout_paths": [r for r, _ in corpus.heldout],
        },
        "tokenizer": {"vocab_size": n_tok, "special_ids": ids},
        "model": {
            "layer_types": list(config.layer_types), "num_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "linear_num_key_heads": config.linear_num_key_heads,
            "linear_num_value_heads": config.linear_num_value_heads,
            "linear_head_dim": config.linear_key_head_dim, "vocab_size": vocab,
            "params_total": n_params, "params_mtp": n_mtp,
        },
        "training": {
            "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
            or platform.machine(),
            "precision": "bf16 autocast, float32 master weights" if use_autocast else "float32",
            "threads": args.threads, "seed": args.seed, "steps": step, "schedule_steps": schedule,
            "exported_step": exported_step,
            "exported_step_note": note, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "tokens_seen": step * tokens_per_step, "epochs": step * tokens_per_step / len(train_stream),
            "train_wall_s": train_wall, "eval_wall_s": eval_s,
            "tokens_per_s": step * tokens_per_step / max(1e-9, train_wall - eval_s),
            "lr": args.lr, "warmup_steps": args.warmup_steps, "min_lr_ratio": args.min_lr_ratio,
            "weight_decay": args.weight_decay, "grad_clip": args.grad_clip, "mtp_weight": args.mtp_weight,
            "max_minutes": args.max_minutes, "max_tokens": args.max_tokens,
            "torch": torch.__version__,
        },
        "heldout": {"loss": final_main, "perplexity": math.exp(final_main), "mtp_loss": final_mtp,
                    "unigram_loss": unigram, "windows": len(windows)},
        "eval_history": history,
    }
    if not args.skip_evidence:
        report.update(run_evidence(out, args.threads))
        log(f"hyserve vs transformers: max |logit diff| {report['crosscheck']['max']:.2e}; "
            f"MTP head vs the training forward: {report['crosscheck']['mtp_max']:.2e}")
        for s in report["samples"]:
            log(f"sample: {s['prompt']!r} -> {s['completion']!r}")
    report["total_wall_s"] = time.perf_counter() - t_start
    report["files"] = dir_size(out)
    report["files"][REPORT_JSON] = 0
    report["files"][REPORT_MD] = 0
    _write_json(os.path.join(out, REPORT_JSON), report)
    write_markdown(out, report)
    sizes = dir_size(out)
    report["files"] = sizes
    _write_json(os.path.join(out, REPORT_JSON), report)
    write_markdown(out, report)
    log(f"done: {sum(sizes.values()) / 1e6:.2f} MB in {out}")
    return report


if __name__ == "__main__":
    main()
