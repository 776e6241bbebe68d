"""A tuning problem, resolved once: the model, its template, the workload and the search space.

Every entry point starts from a :class:`ProblemSpec` (plain and picklable: it is what crosses to
trial ranks and Ray actors) and resolves it here into a :class:`Problem`: the CLI's commands, the
tuner, the trial ranks, the training job (from a schedule file), ``verify`` and the cost model's
measurements. The defaults (global batch, sequence length, the template chosen from the config)
live in this module only, and so does the one wording of "no legal schedule".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from search_spaces import load_template, template_for

from ._inputs import MAX_BATCH, MAX_SEQ_LEN, MAX_WORLD_SIZE
from .errors import UsageError
from .models import ModelSpec
from .plan import Plan, Workload
from .precision import precision
from .space import Space, coerce, format_point, parse_knobs
from .template import ModelInfo, Template

SAMPLES_PER_RANK = 8  # CPU's default global batch: this many samples per rank
MAX_DEFAULT_SEQ_LEN = 128  # CPU's default sequence length: this, or the model's positions if fewer
# GPUs' default global batch in tokens: 2^22 (about 4M), the order of published large-model runs
# (GPT-3 175B: 1536 x 2048 = 3.1M; Llama 2: 4M), in sequences a multiple of the world size
DEFAULT_GLOBAL_TOKENS = 2**22
CONTEXT_FALLBACK = 2048  # a GPU's default sequence length for a config that names no context length


def default_global_batch(world_size: int, seq_len: int | None = None, device: str = "cpu") -> int:
    """CPU (the demo and tests' tiny runs): ``8 x world_size``. GPU: the multiple of the world size
    closest to :data:`DEFAULT_GLOBAL_TOKENS` tokens of ``seq_len`` (one sequence per rank at least)."""
    if device == "cpu" or not seq_len:
        return SAMPLES_PER_RANK * world_size
    per_world = DEFAULT_GLOBAL_TOKENS / (seq_len * world_size)
    return max(1, round(per_world)) * world_size


def default_seq_len(config, device: str = "cpu") -> int:
    """CPU: ``min(128, positions)``. GPU: the model's context length (its positions), what it is
    trained at."""
    positions = getattr(config, "max_position_embeddings", None)
    known = isinstance(positions, int) and positions > 0
    if device != "cpu":
        return positions if known else CONTEXT_FALLBACK
    return min(MAX_DEFAULT_SEQ_LEN, positions) if known else MAX_DEFAULT_SEQ_LEN


_NONE = type(None)
# ProblemSpec's fields as a study records them (JSON): their types
_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "world_size": (int,), "model_overrides": (dict,), "template": (str, _NONE),
    "global_batch": (int, _NONE), "seq_len": (int, _NONE), "precision": (str,), "device": (str,),
    "memory_budget": (int, _NONE), "template_sha256": (str, _NONE)}


@dataclass(frozen=True)
class ProblemSpec:
    """What the user asked for. ``template`` is a registered name, ``module:attribute`` or a
    ``.py`` path (None: chosen from the model's config); ``template_sha256``, for a ``.py`` path,
    is the content it must have (the one a study or a schedule file was made with; resolving
    fills it in, and the path made absolute, so that every rank runs the same file);
    ``global_batch`` and ``seq_len`` default as :func:`default_global_batch` and
    :func:`default_seq_len` say; ``memory_budget`` is bytes per rank (None: unlimited)."""

    model: str
    world_size: int
    model_overrides: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    precision: str = "fp32"
    device: str = "cpu"
    memory_budget: int | None = None
    template_sha256: str | None = None

    @classmethod
    def from_record(cls, record: Any, where: str) -> ProblemSpec:
        """The spec a study recorded (``dataclasses.asdict`` of one), checked field by field: a
        study is data another driver (or anyone with the storage) wrote, so a malformed record is
        a one-line :class:`UsageError`, not a traceback."""
        if not isinstance(record, dict) or not isinstance(record.get("model"), str):
            raise UsageError(f"{where}: its recorded problem is not a slapo-tune problem (no model name)")
        for name, value in record.items():
            kinds = _RECORD_TYPES.get(name)
            if kinds is None:
                raise UsageError(f"{where}: its recorded problem has an unknown field '{name}'")
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise UsageError(f"{where}: its recorded problem's {name} is {type(value).__name__}, not "
                                 f"{' or '.join(k.__name__ for k in kinds)}")
        if record.get("memory_budget") is None:
            raise UsageError(f"{where}: its recorded problem has no memory budget")
        return cls(**record)

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec(self.model, dict(self.model_overrides))

    def resolve(self, config=None, template: Template | None = None) -> Problem:
        """Load the config (unless given), pick the template (unless given: an object a caller
        loaded itself), fill the defaults, build the space; a problem without a single legal
        schedule is a :class:`UsageError`."""
        for name, value, most in (("world size", self.world_size, MAX_WORLD_SIZE),
                                  ("global batch", self.global_batch, MAX_BATCH),
                                  ("sequence length", self.seq_len, MAX_SEQ_LEN)):
            if value is not None and not 1 <= value <= most:
                raise UsageError(f"the {name} must be an integer from 1 to {most}, got {value}")
        try:
            precision(self.precision)
        except Exception as exc:  # noqa: BLE001 - the runtime's ScheduleError, as a usage error
            raise UsageError(str(exc)) from None
        config = config if config is not None else self.model_spec.config()
        if template is None:
            template = load_template(self.template, self.template_sha256) if self.template else template_for(config)
        source = template.source
        positions = getattr(config, "max_position_embeddings", None)
        device = "cpu" if self.device == "cpu" else "cuda"
        seq_len = self.seq_len or default_seq_len(config, device)
        if isinstance(positions, int) and seq_len > positions:
            raise UsageError(f"seq_len {seq_len} is longer than {self.model}'s {positions} positions")
        spec = replace(self, global_batch=self.global_batch or default_global_batch(self.world_size, seq_len, device),
                       seq_len=seq_len)
        if source is not None:
            spec = replace(spec, template=source.path, template_sha256=source.sha256)
        info = replace(ModelInfo.from_config(config), tp_refusal=template.tp_refusal(config))
        workload = Workload(spec.world_size, spec.global_batch, spec.seq_len, spec.precision)
        space = template.space(info, workload)
        if next(space.enumerate(), None) is None:
            raise UsageError(
                f"no legal schedule for {self.model} on {spec.world_size} ranks with global batch {spec.global_batch}: "
                f"tp must divide {info.heads} heads, {info.kv_heads} KV heads, vocab {info.vocab} and MLP width "
                f"{info.intermediate}; pp must be at most {info.layers} layers; the global batch must divide by dp")
        return Problem(spec, config, template, info, workload, space)


@dataclass(frozen=True, eq=False)
class Problem:
    """A resolved :class:`ProblemSpec` (its defaults filled in)."""

    spec: ProblemSpec
    config: Any
    template: Template
    info: ModelInfo
    workload: Workload
    space: Space

    @property
    def model(self) -> ModelSpec:
        return self.spec.model_spec

    @property
    def template_ref(self) -> str:
        """How a rank finds the same template again (the user's reference, or the chosen name)."""
        return self.spec.template or self.template.name

    def plan(self, knobs: Mapping[str, Any] | str = "") -> Plan:
        """The plan for ``knobs`` (a mapping, or text such as ``"tp=2,pp=2"``): values given as
        text are converted to the knobs' types, knobs left out take their first legal value, and an
        unknown or illegal knob is a :class:`UsageError` naming its legal values."""
        return Plan.of(self.space.complete(self._typed(knobs)), self.workload)

    def _typed(self, knobs: Mapping[str, Any] | str) -> dict[str, Any]:
        """``knobs`` (a mapping, or text such as ``"tp=2,pp=2"``), values given as text converted
        to the knobs' types (an unknown knob is a :class:`UsageError`)."""
        if isinstance(knobs, str):
            knobs = parse_knobs(knobs)
        typed = coerce(self.space, {k: v for k, v in knobs.items() if isinstance(v, str)})
        return {k: typed.get(k, v) for k, v in knobs.items()}

    def pinned(self, knobs: Mapping[str, Any] | str) -> Problem:
        """This problem searching only the points with ``knobs`` (a mapping, or text such as
        ``"tp=8,zero=3"``) held (:meth:`Space.pinned`). A value legal in no point is a
        :class:`UsageError` naming the knob's legal values."""
        given = self._typed(knobs)
        if not given:
            return self
        space = self.space.pinned(given)
        if next(space.enumerate(), None) is None:
            self.plan(given)  # names the first illegal knob and its legal values, where one is
            raise UsageError(f"no legal point has {format_point(given)}: pin fewer knobs")
        return replace(self, space=space)

    def plans(self) -> Iterator[Plan]:
        """Every legal plan, in the space's order."""
        for point in self.space.enumerate():
            yield Plan.of(point, self.workload)

    def describe(self) -> str:
        w = self.workload
        return (f"{self.model.name}: template {self.template.describe()}, world {w.world_size}, global batch "
                f"{w.global_batch}, seq {w.seq_len}, {w.precision}")
