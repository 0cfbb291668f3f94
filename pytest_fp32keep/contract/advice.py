"""What a failure message adds to the findings: the differing part of a long pair, and what to do.

Pure text functions used by :class:`~pytest_fp32keep.contract.report.ContractViolation`'s
message: :func:`differing_part` shows where a long expected/observed pair starts to differ (the
common prefix elided with ``"…"``, the first differing element marked ``»like this«``),
:func:`follow_from` folds the parity rows that an earlier failure explains into one line,
:func:`follow_from_operators` likewise the ``operators`` rows of kept modules whose tensors were
stored or gathered low or whose inputs were cast (:func:`explains_operators`), and
:func:`what_to_do` gives one line per failing check kind with the likely cause and the fix in
this project's terms (for a crash, what its error says: :func:`crash_advice`). Nothing here
judges anything; the checks do.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Sequence
from typing import Final

#: A pair whose two cells together are at least this long is "long": worth pointing into.
LONG_PAIR: Final = 40
#: A common prefix longer than this is elided (``"…"`` plus the separator before the difference).
ELIDE_PREFIX: Final = 24
#: The violation's message is laid out this wide (its table, the folded rows, what to do). pytest
#: prints each line after ``"E"`` and the indentation of the line that raised it (12 columns for
#: the contract's ``raise``; 4 with ``--tb=short``): the whole fits 100 columns.
MESSAGE_WIDTH: Final = 88
#: The failing checks that explain failing parity rows: a tensor stored, gathered or fed in the
#: wrong dtype changes the logits, the loss and the gradients after it.
PARITY_CAUSES: Final = ("stored", "materialized", "boundary", "operators")
#: The failing checks that explain failing ``operators`` rows of the same kept module: its
#: weights stored or gathered low, or its inputs cast, change every operator inside it.
OPERATOR_CAUSES: Final = ("stored", "materialized", "boundary")
#: The marks around the first differing element of a long pair.
MARK_OPEN: Final = "»"
MARK_CLOSE: Final = "«"

#: Words (dtypes, operator names, numbers) and the separators between them, alternating.
_PIECES: Final = re.compile(r"[^\s,;=()\[\]]+|[\s,;=()\[\]]+")

#: Per check kind: the likely cause, then the fix, in the project's terms. ``crashed`` is a step
#: that raised (subject: the reference, or the implementation's cast, shard, load, forward,
#: backward or batch). No line names another kind, so that
#: ``pytest.raises(ContractViolation, match=KIND)`` still tells which kinds failed.
WHAT_TO_DO: Final[dict[str, str]] = {
    "stored": "kept tensors are stored in low precision after cast/shard (a blanket "
    "model.to(dtype)?): cast with fp32keep.keep_aware_cast instead, and do not cast again after "
    "sharding",
    "materialized": "kept parameters were all-gathered in low precision: shard kept units with "
    "param_dtype=None (fp32keep.apply_fsdp2 does); '(still sharded)' means forward read a "
    "parameter FSDP2 never all-gathered (a module read without being called)",
    "boundary": "an FSDP unit changed a kept module's activation dtypes: a kept unit with "
    "param_dtype=torch.float32 casts its inputs to FP32; give kept units param_dtype=None and "
    "the caller's other policy fields (fp32keep.apply_fsdp2 does)",
    "operators": "operators inside a kept module ran in other dtypes than unsharded: its "
    "weights reached it in low precision or its inputs were cast (fix those rows first if they "
    "fail), else compare DtypeProbe(model).as_table('ops') of both models",
    "parity": "logits, loss or gradients differ from the unsharded keep-aware reference: fix the "
    "other rows first; alone, it is a numeric change (a hook scaling gradients, reduce_dtype "
    "below FP32 for kept units, different batches per rank), see docs/contract.md",
    "round trip": "a full state dict did not load back exactly in the destination dtype (the "
    "checkpoint's dtype won): load with fp32keep.load_full_state_dict, or copy_ into the "
    "existing parameters instead of load_state_dict(assign=True)",
    "kept count": "fewer tensors are kept in FP32 than expect_kept asks for: the plan keeps what "
    "the installed Transformers keeps at this dtype, and the report's note names the lists its "
    "dtype gate dropped (_keep_in_fp32_modules applies under fp16 only, except in 5.0.0); test "
    "at the dtype the declaration is for, declare _keep_in_fp32_modules_strict, or lower "
    "expect_kept",
    "crashed": "a step of the implementation under test raised (the subject names it: cast, "
    "shard, load, forward, backward or batch); its error is in the observed cell",
}


#: What a ``crashed`` row adds to the kind's line, by what its observed cell (``TYPE: message``)
#: or its subject says, in this order: a crash says which of these it is, not all of them.
CRASH_ADVICE: Final[tuple[tuple[str, str], ...]] = (
    (
        "uniform original parameter dtype",
        "'FSDP expects uniform original parameter dtype' means one FSDP2 unit mixes FP32 kept "
        "parameters with low-precision ones: shard with fp32keep.apply_fsdp2 (kept modules get "
        "units of their own), or store every trainable parameter as an FP32 master "
        "(fp32keep.upcast_to_fp32_master; on torch >= 2.15 with a MixedPrecisionPolicy "
        "param_dtype_override_fn over those FP32 masters)",
    ),
    (
        "KeepLayoutError",
        "a KeepLayoutError from shard is a layout FSDP2 cannot keep: see docs/errors.md, rows "
        "L1-L6",
    ),
)
#: The ``crashed`` line for the unsharded reference (subject ``reference``): nothing of the
#: implementation ran, so the implementation's advice does not apply.
CRASHED_REFERENCE: Final = (
    "the unsharded reference itself failed (or computed NaN) before anything of the "
    "implementation ran; fix the model, its weights or the batch at this dtype"
)


def crash_advice(subject: str, observed: str) -> str:
    """The ``crashed`` line for one crashed row: the reference's own, else the kind's line with
    what the crash's error says added (:data:`CRASH_ADVICE`)."""
    if subject == "reference":
        return CRASHED_REFERENCE
    extra = [advice for phrase, advice in CRASH_ADVICE if phrase in observed]
    return "; ".join([WHAT_TO_DO["crashed"], *extra[:1]])


def differing_part(expected: str, observed: str) -> tuple[str, str]:
    """``expected`` and ``observed`` with their difference made visible, when the pair is long.

    Short pairs, equal pairs and pairs that differ from their first element come back
    unchanged (the difference is already the whole cell). Otherwise the first differing element
    is marked on both sides, and a common prefix longer than :data:`ELIDE_PREFIX` is elided to
    ``"…"`` followed by the separator just before the difference.
    """
    if expected == observed or len(expected) + len(observed) < LONG_PAIR:
        return expected, observed
    want, got = _PIECES.findall(expected), _PIECES.findall(observed)
    common = 0
    while common < min(len(want), len(got)) and want[common] == got[common]:
        common += 1
    if common == 0:
        return expected, observed
    # Where the difference starts in a separator (", " against ")"), _marked marks the element
    # after it; where one side simply ends, it marks "(end)".
    return _marked(want, common), _marked(got, common)


def _is_word(piece: str) -> bool:
    return _PIECES.fullmatch(piece) is not None and re.match(r"[\s,;=()\[\]]", piece) is None


def _marked(pieces: list[str], start: int) -> str:
    """``pieces`` from ``start`` with the first word marked, the prefix elided if long."""
    prefix = "".join(pieces[:start])
    if len(prefix) > ELIDE_PREFIX:
        # Keep the element the difference is in (back to the last "; ", else the last space),
        # e.g. the operator's name: "…aten.add.Tensor(»float32«)", "…args[3]=»bfloat16«".
        bounds = [i for i in range(start) if ";" in pieces[i]] or [
            i for i in range(start) if not _is_word(pieces[i]) and " " in pieces[i]
        ]
        context = pieces[bounds[-1] + 1 : start] if bounds else pieces[max(0, start - 2) : start]
        if len("".join(context)) > ELIDE_PREFIX:
            context = pieces[max(0, start - 2) : start]
        prefix = "…" + "".join(context)
    rest = list(pieces[start:])
    for i, piece in enumerate(rest):
        if _is_word(piece):
            rest[i] = f"{MARK_OPEN}{piece}{MARK_CLOSE}"
            break
    else:
        rest.append(f"{MARK_OPEN}(end){MARK_CLOSE}")
    return prefix + "".join(rest)


def follow_from(
    cause: str, parity_subjects: Sequence[str], width: int = MESSAGE_WIDTH
) -> list[str]:
    """One wrapped entry saying that ``parity_subjects`` (logits, loss, ``grad NAME``) fail
    because ``cause`` failed, and where every row is."""
    grads = sum(1 for subject in parity_subjects if subject.startswith("grad "))
    outputs = [subject for subject in parity_subjects if not subject.startswith("grad ")]
    parts = [*outputs, *([f"{grads} gradient{'s' if grads != 1 else ''}"] if grads else [])]
    return _folded("parity", len(parity_subjects), cause, ", ".join(parts), width)


def operator_module(subject: str) -> str:
    """The kept module an ``operators`` or ``boundary`` row is about (its subject up to
    ``" call "``: ``"layers.0.wo call 0 op #1 aten.mm.default"`` is ``layers.0.wo``'s)."""
    return subject.split(" call ", 1)[0]


def explains_operators(check: str, subject: str, module: str) -> bool:
    """Whether a failing ``check`` row about ``subject`` explains a failing ``operators`` row of
    ``module``: a tensor of that module stored or gathered low, or its activations cast."""
    if check in ("stored", "materialized"):
        return subject.split(" (", 1)[0].startswith(f"{module}.")
    if check == "boundary":
        boundary = operator_module(subject)
        return boundary == module or f"{boundary}.".startswith(f"{module}.")
    return False


def follow_from_operators(
    cause: str, operator_subjects: Sequence[str], width: int = MESSAGE_WIDTH
) -> list[str]:
    """One wrapped entry saying that ``operator_subjects`` fail because ``cause`` failed for
    the same kept modules, and where every row is."""
    modules = list(dict.fromkeys(operator_module(subject) for subject in operator_subjects))
    count = len(modules)
    named = ", ".join(modules[:2]) + (f", {count - 2} more" if count > 2 else "")
    where = f"{count} kept module{'s' if count != 1 else ''}: {named}"
    return _folded("operators", len(operator_subjects), cause, where, width)


def _folded(check: str, rows: int, cause: str, what: str, width: int) -> list[str]:
    text = (
        f"{rows} {check} row{'s' if rows != 1 else ''} follow{'' if rows != 1 else 's'} from the "
        f"{cause} failure above ({what}): fix it first; violation.report.failures "
        "(or report.to_json()) holds every row"
    )
    return textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False)


def what_to_do(
    kinds: Iterable[str],
    width: int = MESSAGE_WIDTH,
    crashes: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """``"what to do:"`` then one ``"  KIND: cause; fix"`` entry per failing kind, in order,
    each wrapped at ``width`` columns (its continuation lines indented by four spaces).

    ``crashes`` (each crashed row's subject and observed cell) makes the ``crashed`` entry
    specific: one entry per distinct :func:`crash_advice`, e.g. the reference's own line only
    where the reference crashed."""
    lines: list[str] = []
    for kind in kinds:
        if kind not in WHAT_TO_DO:
            continue
        texts = [WHAT_TO_DO[kind]]
        if kind == "crashed" and crashes:
            texts = list(dict.fromkeys(crash_advice(*crash) for crash in crashes))
        for text in texts:
            lines += textwrap.wrap(
                f"{kind}: {text}",
                width,
                initial_indent="  ",
                subsequent_indent="    ",
                break_on_hyphens=False,
            )
    return ["what to do:", *lines] if lines else []
