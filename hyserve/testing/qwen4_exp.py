"""The Qwen4-Exp family's tiny checkpoints for tests, laid out as transformers 5.24 saves them, and their reference.

The main venv pins transformers 5.17, which has no ``qwen4_exp``; transformers 5.24 lies in ``REFERENCE_SITE``
(``.venv/reference/transformers-5.24``, installed by scripts/setup.sh) and runs in subprocesses of
``hyserve.testing.qwen4_exp_reference`` (its protocol is described there) with that directory first on
``PYTHONPATH``:

* ``write_tiny_qwen4_exp_checkpoint``: the session's reference process (``shared_process``) builds transformers'
  ``Qwen4ExpForCausalLM`` (form ``causal``) or ``Qwen4ExpForConditionalGeneration`` (form ``vlm``, alias
  ``conditional``: a tiny vision tower) from a tiny config, gives its parameters spread random values and
  ``save_pretrained``s it: the release layout
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``, the n-gram tables as ``split_ngram_parts`` row shards
  ``ple.ple_embedding.ngram_embedding.shard_{i}.weight``, no ``model.norm``, no ``mtp.*``) and config.json with the
  attention layers named ``full_attention`` as the release names them. Tokenizer and generation_config.json as
  Qwen3.5's writers (the VLM form: the VLM tokenizer, chat template and preprocessor_config.json of
  ``hyserve.testing.qwen3_5_vlm``). ``with_mtp=True`` then adds random ``mtp.*`` tensors to the checkpoint's own
  model.safetensors (``add_mtp_tensors``: the head of ``hyserve.model.qwen4_exp_mtp``, its decoder layer named and
  shaped as the checkpoint's attention layer, one tensor per expert) and ``mtp_num_hidden_layers: 1`` to its
  config.json; transformers ignores ``mtp.*`` (``_keys_to_ignore_on_load_unexpected``), so the reference is the same.
* ``load_qwen4_exp_reference``: a ``Qwen4ExpReference``, the checkpoint loaded (float32, CPU, eval, eager
  attention, transformers' PyTorch GDN) in the session's reference process beside the other references' models;
  ``ref(input_ids=..., use_cache=False).logits`` as a transformers model answers, so
  ``hyserve.testing.qwen3_5.reference_logits`` works with it. ``close`` unloads its model.

One process per module (``shared_process``: this family's, or ``hyserve.testing.fp8_qwen4_exp``'s with the FP8
emulation) writes and holds every checkpoint of the session, so transformers 5.24 is imported once (about 10 s of
CPU a process on a busy two-core machine; one process per checkpoint before: 14 for the family's nine test files
in one session, 2 now); it ends at exit, or when ``close_shared_processes`` is called. One that died is started
again for the next write or reference (the references it held fail).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import torch

from hyserve.testing.families import FamilyCheckpoints, register_family
from hyserve.testing.files import write_json
from hyserve.testing.qwen3_5 import write_generation_config_and_tokenizer
from hyserve.testing.tokenizer import ENDOFTEXT, IM_END, special_token_ids, tokenizer_size

REFERENCE_VERSION = "5.24.0"
_SITE_NAME = os.path.join("reference", "transformers-5.24")
REPO_ROOT = Path(__file__).resolve().parents[2]
_SITE_CANDIDATES = (REPO_ROOT / ".venv" / _SITE_NAME, Path(sys.prefix) / _SITE_NAME)
# The directory holding transformers 5.24 (the first candidate that has it; else where scripts/setup.sh puts it).
REFERENCE_SITE = str(next((p for p in _SITE_CANDIDATES if (p / "transformers").is_dir()), _SITE_CANDIDATES[0]))
REFERENCE_MODULE = "hyserve.testing.qwen4_exp_reference"

# Layer orders the family's tests run; each keeps an attention layer, and layer 2 (1-indexed) is a GDN layer, where
# the writer puts PLE by default.
QWEN4_EXP_LAYER_PATTERNS = {
    "gdn3_attn1": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "attn_mid": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "attn_both_ends": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
}


def reference_site() -> str:
    """``REFERENCE_SITE``, checked to hold transformers 5.24."""
    dist = Path(REFERENCE_SITE) / f"transformers-{REFERENCE_VERSION}.dist-info"
    if not (Path(REFERENCE_SITE) / "transformers").is_dir() or not dist.is_dir():
        raise RuntimeError(f"transformers {REFERENCE_VERSION} (the Qwen4-Exp reference) is not installed in "
                           f"{REFERENCE_SITE}: run scripts/setup.sh")
    return REFERENCE_SITE


class ReferenceProcessError(RuntimeError):
    """The reference process failed a command or died; the message holds its traceback or its stderr's tail."""


def _close_process(proc: subprocess.Popen[str], log: IO[bytes], tmp: str) -> None:
    try:
        if proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
    finally:
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


class ReferenceProcess:
    """One ``python -m hyserve.testing.qwen4_exp_reference`` (or ``module``) with transformers 5.24 first on
    ``PYTHONPATH``; its stderr goes to a temporary file (quoted when it fails). Closed by ``close``, when
    garbage-collected, or at exit."""

    def __init__(self, module: str | None = None) -> None:
        site = reference_site()
        paths = [site, str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "TRANSFORMERS_VERBOSITY": "error",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
               "TOKENIZERS_PARALLELISM": "false", "USE_HUB_KERNELS": "0"}
        # As many threads as this process uses (the test suite keeps one per worker).
        env.setdefault("HYSERVE_REFERENCE_THREADS", str(torch.get_num_threads()))
        self.tmp = tempfile.mkdtemp(prefix="qwen4exp-ref-")
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (the process writes it until closed)
        self._proc = subprocess.Popen([sys.executable, "-m", module or REFERENCE_MODULE], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, env=env, text=True,
                                      cwd=str(REPO_ROOT))
        self._lock = threading.Lock()
        self._n = 0
        self._finalizer = weakref.finalize(self, _close_process, self._proc, self._log, self.tmp)

    def _stderr_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - chars))
        return self._log.read().decode("utf-8", "replace")

    def request(self, cmd: str, **fields: Any) -> dict[str, Any]:
        """Send one command and return its reply; raises ``ReferenceProcessError`` if it failed."""
        with self._lock:
            if not self._finalizer.alive:
                raise ReferenceProcessError("the reference process is closed")
            assert self._proc.stdin is not None and self._proc.stdout is not None
            try:
                self._proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
                self._proc.stdin.flush()
                line = self._proc.stdout.readline()
            except OSError as e:
                line = ""
                err: BaseException | None = e
            else:
                err = None
            if not line:
                rc = self._proc.poll()
                raise ReferenceProcessError(f"the Qwen4-Exp reference process ended (exit status {rc}) during "
                                            f"{cmd!r}; its stderr ends with:\n{self._stderr_tail()}") from err
            reply = json.loads(line)
        if not reply.pop("ok", False):
            raise ReferenceProcessError(f"the Qwen4-Exp reference failed {cmd!r}:\n{reply.get('error')}")
        return reply

    def out_path(self, stem: str) -> str:
        """A fresh file path in this process's temporary directory (for tensors it writes)."""
        self._n += 1
        return os.path.join(self.tmp, f"{stem}{self._n}.pt")

    def load_tensor(self, path: str) -> Any:
        try:
            return torch.load(path, weights_only=True)
        finally:
            os.unlink(path)

    def alive(self) -> bool:
        return self._finalizer.alive and self._proc.poll() is None

    def close(self) -> None:
        self._finalizer()


_shared: dict[str, ReferenceProcess] = {}
_shared_lock = threading.Lock()
_model_ids = itertools.count()


def shared_process(module: str | None = None) -> ReferenceProcess:
    """The session's process running ``module`` (default ``REFERENCE_MODULE``): it writes the checkpoints and holds
    every reference's model (transformers imports once); started on first use, and again if it died."""
    module = module or REFERENCE_MODULE
    with _shared_lock:
        proc = _shared.get(module)
        if proc is None or not proc.alive():
            proc = _shared[module] = ReferenceProcess(module)
        return proc


def close_shared_processes() -> None:
    """End the shared processes (they also end at exit)."""
    with _shared_lock:
        procs = list(_shared.values())
        _shared.clear()
    for proc in procs:
        proc.close()


def _default_ple_layers(layer_types: list[str]) -> list[int]:
    """PLE on layer 2 (1-indexed) if it is a GDN layer, else on the first GDN layer."""
    linear = [i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"]
    return [2] if 2 in linear else linear[:1]


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def write_tiny_qwen4_exp_checkpoint(
    path: str | os.PathLike[str], *, form: str = "causal", layer_types: list[str] | None = None, seed: int = 0,
    attention_name: str = "full_attention", with_mtp: bool = False, **overrides: Any,
) -> str:
    """Write a tiny random Qwen4-Exp checkpoint (float32) into ``path`` and return it.

    ``form``: ``causal`` (``Qwen4ExpForCausalLM``, ``qwen4_exp_text``) or ``vlm`` / ``conditional``
    (``Qwen4ExpForConditionalGeneration``, ``qwen4_exp``: ``model.language_model.*``, ``model.visual.*``).
    ``overrides`` replace fields of ``hyserve.testing.qwen4_exp_reference.tiny_text_kwargs`` (``ple_layer_ids``,
    ``hidden_size``, ``indexer_budget``, ...); ``attention_name`` is what config.json calls the attention layers
    (``full_attention`` as the release, or ``indexed_attention`` as transformers writes). ``with_mtp``: an MTP head
    too (``add_mtp_tensors``).
    """
    if form not in ("causal", "vlm", "conditional"):
        raise ValueError(f"form must be 'causal' or 'vlm' (got {form!r})")
    vlm = form != "causal"
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    types = list(layer_types or QWEN4_EXP_LAYER_PATTERNS["attn_mid"])
    ids = special_token_ids()
    text: dict[str, Any] = {"layer_types": types, "ple_layer_ids": _default_ple_layers(types),
                            "eos_token_id": ids[ENDOFTEXT], **_jsonable(overrides)}
    vlm_fields: dict[str, Any] = {}
    if vlm:
        from hyserve.testing.qwen3_5_vlm import (
            IMAGE_PAD,
            TINY_VLM_VISION,
            VIDEO_PAD,
            VISION_END,
            VISION_START,
            vlm_special_token_ids,
        )

        vids = vlm_special_token_ids()
        vlm_fields = {"vision_config": dict(TINY_VLM_VISION), "image_token_id": vids[IMAGE_PAD],
                      "video_token_id": vids[VIDEO_PAD], "vision_start_token_id": vids[VISION_START],
                      "vision_end_token_id": vids[VISION_END]}
        needed = max(vids.values()) + 1
    else:
        needed = tokenizer_size()
    vocab = int(text.get("vocab_size", 512))
    if vocab < needed:
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer ({needed})")
    shared_process().request("write", path=os.path.abspath(path), form="vlm" if vlm else "causal", seed=seed,
                              text=text, vlm=vlm_fields, attention_name=attention_name)
    if vlm:
        _write_vlm_tokenizer(path)
    else:
        write_generation_config_and_tokenizer(path)
    if with_mtp:
        add_mtp_tensors(path, seed=seed)
    return path


def mtp_tensor_shapes(path: str | os.PathLike[str], num_layers: int = 1) -> dict[str, tuple[int, ...]]:
    """The ``mtp.*`` tensors (names and shapes) of a head of ``num_layers`` layers for the checkpoint in ``path``:
    ``fc_embedding`` / ``fc_hidden`` (H, H), ``pre_fc_norm_embedding`` (H), ``pre_fc_norm_hidden`` (S * H), each
    layer the checkpoint's first attention layer's tensors as the checkpoint stores them (PLE never: attention
    layers have none), and the model's ``hyper_connection_mixer`` tensors as ``mtp.hyper_connection_mixer.*``."""
    from safetensors import safe_open

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    text = raw.get("text_config", raw)
    h, s = int(text["hidden_size"]), int(text.get("hc_count", 4))
    attn = next(i for i, t in enumerate(text["layer_types"]) if t != "linear_attention")
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118 (not a mapping)
    base = "model.language_model." if "text_config" in raw else "model."
    layer = f"{base}layers.{attn}."
    out: dict[str, tuple[int, ...]] = {"mtp.fc_embedding.weight": (h, h), "mtp.fc_hidden.weight": (h, h),
                                       "mtp.pre_fc_norm_embedding.weight": (h,),
                                       "mtp.pre_fc_norm_hidden.weight": (s * h,)}
    for i in range(num_layers):
        out.update({f"mtp.layers.{i}.{n.removeprefix(layer)}": shape for n, shape in shapes.items()
                    if n.startswith(layer) and ".ple." not in n})
    mixer = f"{base}hyper_connection_mixer."
    out.update({f"mtp.hyper_connection_mixer.{n.removeprefix(mixer)}": shape for n, shape in shapes.items()
                if n.startswith(mixer)})
    return out


def add_mtp_tensors(path: str | os.PathLike[str], *, seed: int = 0, num_layers: int = 1) -> None:
    """Add random ``mtp.*`` tensors (``mtp_tensor_shapes``; values as the writer draws the model's) to the
    checkpoint's own model.safetensors, and ``mtp_num_hidden_layers`` to its config.json (under ``text_config`` in
    the conditional form)."""
    from safetensors.torch import load_file, save_file

    from hyserve.testing.qwen4_exp_reference import init_tensor

    path = os.fspath(path)
    if os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        raise ValueError(f"{path}: a sharded checkpoint; add_mtp_tensors writes into the one model.safetensors")
    gen = torch.Generator().manual_seed(10_000 + seed)
    mtp = {n: init_tensor(n, shape, gen).contiguous() for n, shape in mtp_tensor_shapes(path, num_layers).items()}
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    clash = sorted(set(tensors) & set(mtp))
    if clash:
        raise ValueError(f"{path} already holds {clash[0]}")
    save_file({**tensors, **mtp}, weights, metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    raw.get("text_config", raw)["mtp_num_hidden_layers"] = num_layers
    write_json(cfg_path, raw)


def _write_vlm_tokenizer(path: str) -> None:
    """The VLM tokenizer files, chat template and preprocessor_config.json of ``hyserve.testing.qwen3_5_vlm``."""
    from hyserve.testing.qwen3_5_vlm import (
        VISION_TOKENS,
        VLM_CHAT_TEMPLATE,
        tiny_preprocessor_config,
        vlm_special_token_ids,
        vlm_tokenizer_json,
    )
    from hyserve.testing.tokenizer import tokenizer_config

    ids = vlm_special_token_ids()
    write_json(os.path.join(path, "generation_config.json"),
               {"eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT], "do_sample": False,
                "transformers_version": REFERENCE_VERSION})
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(vlm_tokenizer_json())
    tok_config = tokenizer_config(ids, 4096)
    for token in VISION_TOKENS:
        tok_config["added_tokens_decoder"][str(ids[token])] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
    tok_config["chat_template"] = VLM_CHAT_TEMPLATE
    write_json(os.path.join(path, "tokenizer_config.json"), tok_config)
    write_json(os.path.join(path, "preprocessor_config.json"), tiny_preprocessor_config())


class Qwen4ExpReference:
    """transformers 5.24's model of one checkpoint, in the session's reference process (``shared_process`` of
    ``module``); called as a transformers model is (``ref(input_ids=ids, use_cache=False).logits``: float32
    ``(B, T, V)`` on the CPU).

    ``config``: the text config's fields (``vocab_size``, ``indexer_budget``, ...); ``loading_info``:
    ``from_pretrained``'s missing / unexpected / mismatched keys; ``architecture``: the class loaded."""

    def __init__(self, path: str | os.PathLike[str], *, attn_implementation: str = "eager",
                 module: str | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self._process = shared_process(module)
        self._model = f"m{next(_model_ids)}"
        info = self._request("load", path=self.path, attn_implementation=attn_implementation)
        self._finalizer = weakref.finalize(self, _unload_later, self._process, self._model)
        self.info = info
        self.architecture: str = info["architecture"]
        self.loading_info: dict[str, list[str]] = info["loading_info"]
        self.config = SimpleNamespace(**info["text_config"])

    def __call__(self, input_ids: torch.Tensor | list[list[int]], *, use_cache: bool = False,
                 attention_mask: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                 image_grid_thw: torch.Tensor | None = None) -> SimpleNamespace:
        """``pixel_values`` and ``image_grid_thw`` (the VLM form): the images of the placeholders in ``input_ids``
        (each widened to its grid), as transformers' image processor gives them."""
        if use_cache:
            raise ValueError("the Qwen4-Exp reference runs uncached forwards; cached_logits runs a cached decode")
        ids = torch.as_tensor(input_ids, dtype=torch.long).cpu()
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(ids.shape)}")
        mask = None if attention_mask is None else torch.as_tensor(attention_mask).long().cpu().tolist()
        images = None
        if pixel_values is not None:
            if image_grid_thw is None:
                raise ValueError("pixel_values need their image_grid_thw")
            images = self._process.out_path("images")
            torch.save({"pixel_values": pixel_values.float().cpu(), "image_grid_thw": image_grid_thw.cpu()}, images)
        out = self._process.out_path("logits")
        try:
            self._request("logits", ids=ids.tolist(), attention_mask=mask, images=images, out=out)
        finally:
            if images is not None:
                os.unlink(images)
        return SimpleNamespace(logits=self._process.load_tensor(out))

    def eval(self) -> Qwen4ExpReference:
        return self

    def cached_logits(self, token_ids: list[int], prefill: int) -> torch.Tensor:
        """transformers' own cached decode: ``token_ids[:prefill]`` in one forward, then one token per forward;
        the float32 logits of every position, ``(len(token_ids), vocab)``."""
        out = self._process.out_path("cached")
        self._request("generate_cached", ids=[int(t) for t in token_ids], prefill=int(prefill), out=out)
        result: torch.Tensor = self._process.load_tensor(out)
        return result

    def ngram_rows(self, token_ids: list[int], prefill: int | None = None) -> dict[int, torch.Tensor]:
        """The n-gram table rows each PLE layer (0-based layer index) looks up for each token, ``(T, heads)``:
        from one uncached forward, or (``prefill``) from a cached decode as ``cached_logits`` runs it."""
        out = self._process.out_path("ngram")
        self._request("ngram_rows", ids=[int(t) for t in token_ids], prefill=prefill, out=out)
        rows: dict[int, torch.Tensor] = self._process.load_tensor(out)
        return rows

    def _request(self, cmd: str, **fields: Any) -> dict[str, Any]:
        _send_unloads(self._process)
        return self._process.request(cmd, model=self._model, **fields)

    def close(self) -> None:
        """Unload this reference's model (the process goes on serving the others)."""
        if self._finalizer.detach() is not None and self._process.alive():
            _send_unloads(self._process)
            self._process.request("unload", model=self._model)


# Models of references garbage-collected without ``close``, unloaded with the next request to their process (not
# from the finalizer: it may run inside another request, under the process's lock).
_unloads: list[tuple[ReferenceProcess, str]] = []


def _unload_later(process: ReferenceProcess, model: str) -> None:
    _unloads.append((process, model))


def _send_unloads(process: ReferenceProcess) -> None:
    for entry in [u for u in list(_unloads) if u[0] is process]:
        _unloads.remove(entry)
        if process.alive():
            process.request("unload", model=entry[1])


def load_qwen4_exp_reference(path: str | os.PathLike[str]) -> Qwen4ExpReference:
    """transformers 5.24's model of the checkpoint in ``path`` (float32, CPU, eval), in the session's reference
    process."""
    return Qwen4ExpReference(path)


QWEN4_EXP = register_family(FamilyCheckpoints("qwen4_exp", write_tiny_qwen4_exp_checkpoint, load_qwen4_exp_reference,
                                              QWEN4_EXP_LAYER_PATTERNS))
