"""Options shared by `generate`, `bench` and `serve`, declared once, and the checks every command
applies to its arguments: nonsense (a negative count, nan, a file given for a directory, a path that
cannot be written) is one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from moetier.engine.config import EngineConfig
from moetier.errors import MoetierError
from moetier.experts import registry as _backends
from moetier.experts.placement import ExpertOptions
from moetier.server import parsers as _parsers

# -- the record ---------------------------------------------------------------------------------------
# Every user option that sets the engine or the experts is a field of EngineConfig (engine/config.py)
# or ExpertOptions (experts/placement.py); its default is that field's default, written there once,
# and the commands' signatures read it from ENGINE / EXPERTS. Flag -> field; tests/test_options.py
# checks every option of generate, serve, plan and bench against these tables, so a new user option
# is one field in a record, one line here and one Annotated declaration below.
ENGINE, EXPERTS = EngineConfig(), ExpertOptions()
ENGINE_FIELDS = {
    "--max-num-seqs": "max_num_seqs", "--max-num-tokens": "max_num_tokens", "--kv-tokens": "kv_tokens",
    "--max-model-len": "max_model_len", "--decode-tokens": "decode_tokens",
    "--record-trace": "record_trace", "--replay-trace": "replay_trace", "--tp": "tensor_parallel_size",
    "--ep": "expert_parallel_size", "--distributed-executor": "distributed_executor",
    "--step-record-group": "step_record_group", "--dense-weights": "dense_weights",
    "--enable-prefix-caching": "enable_prefix_caching", "--kv-host-memory": "kv_host_bytes",
    "--speculative-config": "speculative_config", "--async-scheduling": "async_scheduling",
}
EXPERT_FIELDS = {"--expert-backend": "backend", "--expert-slots": "slots", "--expert-slots-file": "slots_per_layer",
                 "--cache-policy": "policy", "--expert-split": "split", "--pinned-experts-file": "pinned",
                 "--prefill-cache": "prefill", "--prefill-stream": "prefill_stream"}
# The command line's own defaults, where they differ from the records' on purpose: --expert-backend
# auto (the memory plan chooses; the Python API without a plan builds resident), --expert-slots-file
# none (no per-layer counts), --pinned-experts-file none (nothing pinned unless the plan pins), and one request at a time for generate (and for plan, which plans what
# generate runs unless told otherwise); --kv-host-memory is a size string, "0" the record's 0 bytes.
CLI_DEFAULTS = {"--expert-backend": _backends.AUTO, "--expert-slots-file": None, "--pinned-experts-file": None,
                "--kv-host-memory": "0"}
ONE_REQUEST = 1


def fail(e: Exception | str) -> NoReturn:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2)


# -- the model and where it runs ------------------------------------------------------------------
Model = Annotated[Optional[Path], typer.Option(
    "--model", metavar="<dir>", help="Hugging Face checkpoint directory (default: the embedded tiny model, tiny-stdlib, "
    "shipped with moetier).")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto (the checkpoint's), float32, bfloat16 or float16; with "
                                     "--preset also a weight format (fp8): the routed experts in it, dense bf16.")]
Device = Annotated[str, typer.Option("--device", help="auto (cuda when available), cuda or cpu.")]

# -- expert tiers -----------------------------------------------------------------------------------
ExpertBackend = Annotated[str, typer.Option("--expert-backend", help=_backends.choices_help())]
ExpertSlots = Annotated[Optional[int], typer.Option(
    "--expert-slots", help="Slots per MoE layer for --expert-backend slots (default: as many as the memory plan "
    "fits).")]
ExpertSlotsFile = Annotated[Optional[Path], typer.Option(
    "--expert-slots-file", metavar="<file>", help="Slots per MoE layer (from `moetier trace plan-slots` or "
    "`moetier plan --pinned-out`); bench decode runs one more slots (and hybrid) row with them.")]
PinnedExpertsFile = Annotated[Optional[Path], typer.Option(
    "--pinned-experts-file", metavar="<file>", help="Experts per MoE layer pinned on the GPU with no host copy "
    "(from `moetier plan --pinned-out`); the rest are cached. Slots and hybrid backends.")]
ExpertSplit = Annotated[str, typer.Option(
    "--expert-split", help="Routed experts under --tp: auto (the default: columns whenever valid), replicate "
    "(every rank holds every expert whole) or columns (every rank holds 1/tp of every expert's intermediate columns; "
    "docs/parallel.md).")]
CachePolicy = Annotated[str, typer.Option(
    "--cache-policy", help="Slot cache victims: lfru (frequency-weighted LRU) or lru.")]

# -- memory budgets (moetier/plan) -------------------------------------------------------------------
GpuMemory = Annotated[Optional[str], typer.Option(
    "--gpu-memory", metavar="<size>", help="Device memory this run may use: 139GiB, 150GB or 90% of the card "
    "(default: the card's free memory).")]
HostMemory = Annotated[Optional[str], typer.Option(
    "--host-memory", metavar="<size>", help="Host memory available: 100GiB, 120GB or 80% of MemTotal (default: the "
    "least of MemAvailable and the cgroup's room).")]

KvHostMemory = Annotated[str, typer.Option(
    "--kv-host-memory", metavar="<size>", help="Pinned host memory for the host KV tier: prefix-cache pages evicted "
    "from the GPU are kept there and copied back on a hit, like 16GiB or 20GB; 0 (the default): no host tier, the "
    "host memory stays the expert store's. The memory plan counts it in the host budget.")]

# -- engine -----------------------------------------------------------------------------------------
MaxNumSeqs = Annotated[int, typer.Option("--max-num-seqs", help="Requests running at once.")]
KvTokens = Annotated[int, typer.Option("--kv-tokens", help="Tokens the KV pool holds, over all requests.")]
MaxModelLen = Annotated[Optional[int], typer.Option(
    "--max-model-len", help="Prompt + output tokens per request (default: the model's); sizes the KV pool.")]
RecordTrace = Annotated[Optional[Path], typer.Option("--record-trace", metavar="<file>",
                                                     help="Write the routing of this run.")]
ReplayTrace = Annotated[Optional[Path], typer.Option("--replay-trace", metavar="<file>",
                                                     help="Route by this trace's experts instead of the router's.")]
PrefixCaching = Annotated[bool, typer.Option(
    "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse the KV pages of prompt prefixes already "
    "computed (full pages, hash-keyed, shared, evicted least recently used): a prompt whose start is cached skips "
    "its prefill. On by default.")]
AsyncScheduling = Annotated[bool, typer.Option(
    "--async-scheduling/--no-async-scheduling", help="Plan and launch each decode step while the GPU runs the one "
    "before it, its input tokens taken on the GPU (the same tokens as stepping one at a time; docs/engine.md). "
    "Off by default.")]
DecodeTokens = Annotated[int, typer.Option(
    "--decode-tokens", help="Steps of up to this many tokens are decode steps (CUDA graphs, the expert cache); "
    "larger ones (prefill) bypass the cache.")]
DenseWeights = Annotated[str, typer.Option(
    "--dense-weights", help="A quantized checkpoint's dense projections: dequantize (to the model dtype, at load; "
    "faster for FP8) or keep (in the checkpoint's format: FP8 half the bytes, NVFP4 / INT4 about a quarter; "
    "docs/fp8.md, docs/quant4.md).")]

PrefillCache = Annotated[str, typer.Option(
    "--prefill-cache", help="What a prefill step does to the slot cache (slots, hybrid): bypass (leave it alone) or "
    "refresh (move the prompt's most used experts into slots for the decode that follows).")]
PrefillStream = Annotated[str, typer.Option(
    "--prefill-stream", help="How a prefill step brings in the experts not in slots (slots, hybrid): uva (read across "
    "the link inside the expert GEMM) or ring (copied by the copy engine into a staging ring while the GEMM runs "
    "the others; one host read of the miss list per layer).")]
MaxNumTokens = Annotated[Optional[int], typer.Option(
    "--max-num-tokens", help="Tokens computed in one step, the prefill chunk (default: chosen from the memory plan: "
    "2048 with every expert in GPU memory, up to 8192 with experts off the GPU; the plan says why).")]
SpeculativeConfigOption = Annotated[Optional[str], typer.Option(
    "--speculative-config", metavar="<json>", help="Speculative decoding, as vLLM spells it: "
    "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}' (the checkpoint's MTP layers) or "
    "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 3}' (prompt lookup); "
    "docs/speculative.md. Greedy outputs equal decoding without it; n-gram verify steps replay CUDA graphs where "
    "they fit, MTP steps and glm5_next / GLM-5 verify steps run eagerly.")]


def speculative_config(text: str | None):
    """The checked --speculative-config record (None: off); every problem one line."""
    from moetier.spec.config import speculative_config_of

    return speculative_config_of(text, "--speculative-config")


def kv_host_memory(text: str) -> int:
    """--kv-host-memory -> bytes (0: no host tier)."""
    from moetier.plan.units import parse_size

    return 0 if text.strip() in ("0", "0B", "0GiB", "0GB") else parse_size(text, "--kv-host-memory")


def prefill_cache(value: str) -> str:
    if value not in ("bypass", "refresh"):
        raise MoetierError(f"--prefill-cache {value!r}: choose bypass or refresh")
    return value


def prefill_stream(value: str) -> str:
    if value not in ("uva", "ring"):
        raise MoetierError(f"--prefill-stream {value!r}: choose uva or ring")
    return value


# -- several processes (moetier/dist, docs/parallel.md) -------------------------------------------------
TensorParallel = Annotated[int, typer.Option(
    "--tp", help="Tensor-parallel ranks: attention heads and dense MLP columns split over N processes (one per "
    "GPU; --device cpu runs them over gloo). MLA models (DeepSeek-V3, GLM-5) keep the whole latent KV cache on "
    "every rank.")]
ExpertParallel = Annotated[int, typer.Option(
    "--ep", help="Expert-parallel ranks: each of N processes holds 1/N of the routed experts (expert e on rank "
    "e % N). With --tp, equal to it or 1.")]
DistributedExecutor = Annotated[str, typer.Option(
    "--distributed-executor", help="Who starts the other ranks of --tp/--ep: mp (processes on this machine, one "
    "per GPU) or ray (Ray actors, one per GPU on the nodes of a Ray cluster; pip install 'moetier[ray]').")]


def executor(name: str) -> str:
    """--distributed-executor, checked at once: an unknown name, or ray without ray installed, is one
    line before anything loads."""
    if name not in ("mp", "ray"):
        raise MoetierError(f"--distributed-executor {name!r}: choose mp or ray")
    if name == "ray":
        from moetier.dist.ray_executor import import_ray

        import_ray()
    return name


def pinned_experts(path: Path | None, backend: str) -> dict[int, tuple[int, ...]]:
    """--pinned-experts-file: the pinned experts per MoE layer ({} without the flag)."""
    if path is None:
        return {}
    if backend == _backends.AUTO or not _backends.backend_kind(backend).cached:
        raise MoetierError("--pinned-experts-file needs --expert-backend slots or hybrid")
    from moetier.experts.cache.split import read_pinned_file

    return read_pinned_file(input_file(path, "--pinned-experts-file"))


def expert_slots_file(path: Path | None) -> dict[int, int]:
    """--expert-slots-file: the slots per MoE layer ({} without the flag)."""
    if path is None:
        return {}
    from moetier.experts.placement import read_slots_file

    return read_slots_file(input_file(path, "--expert-slots-file"))


def expert_options(backend: str, slots: int | None = None, slots_file: Path | None = None,
                   policy: str = EXPERTS.policy, split: str = "auto", prefill: str = EXPERTS.prefill,
                   stream: str = EXPERTS.prefill_stream):
    """ExpertOptions from the shared flags, with the combinations that make no sense refused."""
    from moetier.experts.placement import ExpertOptions

    if backend != _backends.AUTO:
        _backends.backend_kind(backend)  # an unknown name: one line naming the choices
    if (slots is not None or slots_file is not None) and backend == _backends.AUTO:
        backend = _backends.Slots.name  # a slot count says which backend
    if (slots is not None or slots_file is not None) and not _backends.backend_kind(backend).cached:
        cached = [k.name for k in _backends.KINDS.values() if k.cached]
        raise MoetierError(f"--expert-slots and --expert-slots-file need --expert-backend {cached[0]} (or "
                           f"{_backends.either(cached[1:])})")
    if slots is not None and slots_file is not None:
        raise MoetierError("give --expert-slots or --expert-slots-file, not both")
    if slots is not None and slots < 1:
        raise MoetierError(f"--expert-slots {slots}: it must be at least 1")
    per_layer = expert_slots_file(slots_file)
    return ExpertOptions(backend=backend, slots=slots, slots_per_layer=per_layer, policy=policy,
                         split=expert_split(split), prefill=prefill_cache(prefill), prefill_stream=prefill_stream(stream))


def expert_split(split: str) -> str:
    from moetier.experts.parallel.columns import SPLITS

    if split not in SPLITS:
        raise MoetierError(f"--expert-split {split!r}: choose one of {', '.join(SPLITS)}")
    return split


def engine_config(model_dir: Path, max_model_len: int | None, max_num_seqs: int, **options):
    """engine_config_for the model in model_dir."""
    from moetier.models.registry import config_from_dir

    return engine_config_for(config_from_dir(model_dir).max_position_embeddings, max_model_len, max_num_seqs,
                             **options)


def engine_config_for(limit: int, max_model_len: int | None, max_num_seqs: int, **options):
    """EngineConfig whose KV pool holds max_num_seqs requests of max_model_len tokens (default: the
    model's limit, `limit`) by the one sizing rule (plan/memory.kv_pool_tokens), so the memory plan
    and the engine count the same pages."""
    from moetier.engine.config import EngineConfig
    from moetier.plan.memory import kv_pool_tokens

    if max_model_len is not None:
        at_least(max_model_len, 2, "--max-model-len")
    if max_model_len is not None and max_model_len > limit:
        raise MoetierError(f"--max-model-len {max_model_len:,}: the model's limit is {limit:,} tokens "
                           "(max_position_embeddings in its config.json); give at most that, or leave the option "
                           "out to use it")
    length = max_model_len or limit
    page = options.get("page_size", EngineConfig.page_size)
    return EngineConfig.of(max_num_seqs=max_num_seqs, max_model_len=length,
                           kv_tokens=kv_pool_tokens(max_num_seqs, length, page), **options)


# -- checks -------------------------------------------------------------------------------------------
API_KEY_ENV = "MOETIER_API_KEY"


def api_key(key: str | None) -> None:
    """An empty key would serve without one: refused. NOTE: click drops an empty environment variable
    (the option reads None), so the environment is looked at here too."""
    import os

    if (key is not None and not key.strip()) or (key is None and not os.environ.get(API_KEY_ENV, "x").strip()):
        raise MoetierError(f"the API key is empty (--api-key or {API_KEY_ENV}): give a key, or leave both out "
                           "(unset the variable) to serve without one")


def positive(value: float, option: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise MoetierError(f"{option} {value}: it must be a positive number")


def at_least(value: int, low: int, option: str) -> None:
    if value < low:
        raise MoetierError(f"{option} {value}: it must be at least {low}")


def input_file(path: Path, option: str) -> Path:
    """A readable file, or one line saying what is wrong."""
    if path.is_dir():
        raise MoetierError(f"{option} {path} is a directory; give a file")
    if not path.is_file():
        raise MoetierError(f"{option} {path}: no such file")
    return path


def output_file(path: Path, option: str) -> Path:
    """A file path that can be written (its folder is made), checked before any work is done."""
    if path.is_dir():
        raise MoetierError(f"{option} {path} is a directory; give a file name")
    above = next((p for p in path.parents if p.exists()), None)  # the nearest existing folder (or file)
    if above is not None and not above.is_dir():
        raise MoetierError(f"{option} {path}: {above} is a file, not a directory (Not a directory); "
                           "choose a path in a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "ab"):
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        raise MoetierError(f"{option} {path}: cannot write there ({e.strerror or e}); choose a writable path") from None
    return path


def int_list(text: str, option: str) -> list[int]:
    """'512,1024' -> [512, 1024]; anything else is one clear error."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise MoetierError(f"{option} {text!r}: give comma-separated whole numbers, like 512,2048")
    return values


# -- serving: the reply parsers (moetier/server/parsers.py owns the names) ------------------------------
def _parser_help(kind: str, names: list[str]) -> str:
    return (f"How replies are split into {kind} (vLLM's names): {', '.join(names)}; auto (the default) is the "
            "model family's format, none turns it off.")


ToolCallParser = Annotated[str, typer.Option(
    "--tool-call-parser", help=_parser_help("content and tool calls", _parsers.tool_call_parser_names()))]
ReasoningParser = Annotated[str, typer.Option(
    "--reasoning-parser", help=_parser_help("reasoning and content", _parsers.reasoning_parser_names()))]


def parsers(tool_call: str, reasoning: str) -> _parsers.Parsers:
    """The checked choice (an unknown name is one line naming the choices)."""
    return _parsers.Parsers(tool_call, reasoning)
