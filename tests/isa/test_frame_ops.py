"""The frame's opcodes declare their place in a step (OpSpec.step, ends_step, waits_on, check):
which steps have them, which ends the step, what each waits on and how a record is checked
against a build. Consumers read the declaration; only the declarations and the opcodes' own
handlers name them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megakernel import isa
from megakernel.executor import executor_gpu
from megakernel.isa import Op
from megakernel.kernel.config.model_spec import make_spec
from megakernel.launch.checks import ArgumentError, check_records
from megakernel.models import preset
from megakernel.program.compiler import compile_program
from megakernel.program.verify import check_program

PKG = Path(isa.__file__).resolve().parents[1]
# the declarations and the opcodes' handlers: the persistent loop (EMBED, ARGMAX, ACCEPT), the
# device drafter, the kernel's table of the loop's own opcodes, the executor's op functions
OWNERS = ("layers/frame.py", "layers/speculative.py", "kernel/device/megakernel.py",
          "kernel/device/speculative.py", "kernel/config/fields.py", "executor/ops/frame.py",
          "executor/tp.py")
# Op.X, or "X" as a value (a header field of the same name, "NGRAM": ..., is not the opcode)
FRAME = "ACCEPT|NGRAM|ARGMAX|EMBED"
NAMED = re.compile(rf"\bOp\.({FRAME})\b|([\"'])({FRAME})\2(?!\s*:)")


def naming_sites(paths: list[Path]) -> list[str]:
    """file:line of every mention of a frame opcode by name (Op.X or "X") in `paths`."""
    out = []
    for p in paths:
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if NAMED.search(line.split("#", 1)[0]):
                out.append(f"{p}:{n}")
    return out


def test_the_steps_frame_opcodes() -> None:
    assert isa.frame_ops("all") == (Op.END, Op.EMBED, Op.LMHEAD)
    assert isa.step_ops() == (Op.END, Op.EMBED, Op.LMHEAD, Op.ARGMAX)
    assert isa.step_ops(drafts=3) == (Op.END, Op.EMBED, Op.LMHEAD, Op.ACCEPT)
    assert isa.step_ops(drafts=3, ngram=2)[-1] == Op.NGRAM
    assert isa.step_ops(ngram=2) == isa.step_ops()  # no drafter without drafts
    assert [s.name for s in isa.specs() if s.ends_step] == ["ARGMAX", "ACCEPT"]
    assert isa.spec(Op.NGRAM).waits_on == "ACCEPT" and isa.spec(Op.ACCEPT).waits_on == "LMHEAD"
    with pytest.raises(ValueError, match="no frame step 'greedy'"):
        isa.frame_ops("greedy")


def test_a_step_declaration_belongs_to_the_frame() -> None:
    with pytest.raises(ValueError, match="a frame opcode's"):
        isa.OpSpec(90, "X", "attention", "x", (), step="plain")
    with pytest.raises(ValueError, match="a frame opcode's"):
        isa.OpSpec(90, "X", "frame", "x", (), step="sometimes")


def test_only_the_declarations_and_handlers_name_the_frame_opcodes() -> None:
    others = [p for p in sorted(PKG.rglob("*.py"))
              if p.relative_to(PKG).as_posix() not in OWNERS]
    assert len(others) > 100
    assert naming_sites(others) == []


def test_the_name_scan_sees_a_planted_mention(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("x = 1\nend = [isa.Op.ARGMAX, isa.Op.ACCEPT]\n# Op.NGRAM in a comment\n")
    assert naming_sites([f]) == [f"{f}:2"]


def test_a_drafter_record_is_checked_by_its_declaration() -> None:
    """NGRAM's own check (layers/speculative.check_ngram) through check_records: a record past
    the build's sequences or suffix length is refused."""
    cfg = preset("llama-tiny")
    prog = compile_program(cfg, 2, executor_gpu(8), max_seq_len=40, drafts=2, ngram=2)
    spec = make_spec(cfg, 2, 3, "sm_90a", drafts=2, ngram=2).to_dict()
    recs = prog.records()
    check_records(recs, spec)
    sm, pos = (recs[:, :, 0] == int(Op.NGRAM)).nonzero()[0].tolist()
    for field, value, match in (("B1", 3, "sequences"), ("N_MAX", 3, "suffix length 3")):
        bad = recs.clone()
        bad[sm, pos, isa.field_index(Op.NGRAM, field)] = value
        with pytest.raises(ArgumentError, match=match):
            check_records(bad, spec)


@pytest.mark.parametrize("model, batch, tokens, opts", [
    ("llama-tiny", 2, 2, {}),  # rows (4) != sequences (2): EMBED covers rows
    ("llama-tiny", 2, 1, {"drafts": 2, "ngram": 2}),  # ACCEPT, then NGRAM per sequence
    ("qwen3.5-tiny", 2, 1, {"drafts": 2, "replay_window": 4}),  # COMMITs after ACCEPT
], ids=["plain-T2", "ngram", "hybrid-commit"])
def test_every_sort_of_step_passes_the_verifier(model: str, batch: int, tokens: int,
                                                opts: dict) -> None:
    """The verifier's dataflow and coverage of the frame come from the declarations (waits_on,
    covers, starts_step, a kind's `after`): each sort of step passes, with the frame's opcodes
    the step declares."""
    prog = compile_program(preset(model), batch, executor_gpu(8), tokens=tokens, max_seq_len=40,
                           **opts)
    check_program(prog)
    ops = {int(o) for o in prog.records()[:, :, 0].flatten().tolist()}
    frame = {int(o) for s in isa.FRAME_STEPS for o in isa.frame_ops(s)}
    want = {int(o) for o in isa.step_ops(opts.get("drafts", 0), opts.get("ngram", 0))}
    assert ops & frame == want


def test_the_program_and_the_build_count_a_speculative_steps_tokens_alike() -> None:
    from megakernel.kernel.host.limits import step_tokens

    assert (step_tokens(1, 3), step_tokens(4, 3), step_tokens(2, 0)) == (4, 4, 2)
    cfg = preset("llama-tiny")
    prog = compile_program(cfg, 2, executor_gpu(8), max_seq_len=40, drafts=3)
    assert prog.tokens == make_spec(cfg, 2, 1, "sm_90a", drafts=3).tokens == 4
