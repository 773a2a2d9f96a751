"""The hang report's pieces without a job: the collective tracking from the flight recorder's
numbers, the ranks that never arrived, the report's text, the lost rank's line, --log-straggler's
line. The functional tests (tests/functional/test_stalls.py) run them in a 2-rank job."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from megatron.training import hang_report
from megatron.training.hang_report import Part, Pending, Waited, absent, compose, pending_for
from megatron.training.peers import Loss
from megatron.training.stragglers import straggler_line

NAMES = {"0": ["world group", [0, 1, 2]], "3": ["data-parallel group (dp)", [0, 1, 2]]}


def test_a_collective_is_pending_from_when_the_watcher_first_saw_it():
    seen: dict[str, Pending] = {}
    assert pending_for({"3": (5, 5)}, seen, now=1.0) is None
    first = pending_for({"3": (7, 5)}, seen, now=2.0)  # #6 and #7 entered, #6 the oldest not done
    assert (first.pg, first.seq, first.since) == ("3", 6, 2.0)
    assert pending_for({"3": (8, 5)}, seen, now=3.0).since == 2.0  # still #6: the same wait
    assert pending_for({"3": (8, 6)}, seen, now=4.0).since == 4.0  # #6 done, #7 pending since now
    assert pending_for({"3": (8, 8)}, seen, now=5.0) is None and seen == {}


def test_the_heartbeat_carries_each_groups_last_collective():
    seqs = {"3": (57, 56), "0": (2, 2)}
    text = hang_report.encode_seqs(seqs)
    assert " " not in text and hang_report.decode_seqs(text) == {"3": 57, "0": 2}
    assert hang_report.encode_seqs({}) == "-" and hang_report.decode_seqs("-") == {}


def test_the_ranks_that_never_arrived_are_those_behind_the_waited_collective():
    waited = Waited(by=0, op="all_reduce", pg="3", seq=57, seconds=8.0, ranks=[0, 1, 2])
    # rank 1 is at #56 on the group (never entered #57), rank 2 entered it; nothing known: absent.
    assert absent(waited, {1: {"3": 56}, 2: {"3": 57}}) == [1]
    assert absent(waited, {2: {"3": 57}}) == [1]
    assert absent(None, {}) == []


def test_a_collective_is_named_by_its_group():
    assert (
        hang_report.collective_text("all_reduce", 57, "3", NAMES)
        == "all_reduce #57 on the data-parallel group (dp) [0, 1, 2]"
    )
    assert hang_report.collective_text("", 4, "9", NAMES) == "a collective #4 on process group 9"


def test_the_report_names_who_never_arrived_and_shows_every_live_stack():
    waited = Waited(by=0, op="all_reduce", pg="3", seq=57, seconds=8.0, ranks=[0, 1, 2])
    stack = ['  File "train.py", line 3, in step', "    handle.wait()"]
    parts = {
        0: Part(
            0,
            100,
            "node0",
            40,
            stack,
            [dict(op="all_reduce", pg="3", seq=57, p2p=False, done=False)],
            {"3": [57, 56]},
            NAMES,
        ),
        2: Part(
            2,
            102,
            "node1",
            40,
            ['  File "data.py", line 9, in read', "    f.read()"],
            [],
            {"3": [57, 56]},
            NAMES,
        ),
    }
    text = compose(
        "rank 1 (pid 101, host node0) stopped responding", 3, parts,
        {1: "stopped (SIGSTOP or Ctrl-Z): no stack"}, waited,
        {0: {"3": 57}, 1: {"3": 56}, 2: {"3": 57}}, "--distributed-timeout-seconds-after-init 10",
    )  # fmt: skip
    lines = text.splitlines()
    assert lines[0].startswith("hang report (") and lines[0].endswith(
        ", --distributed-timeout-seconds-after-init 10):"
    )
    assert lines[1:4] == [
        "  rank 1 (pid 101, host node0) stopped responding",
        "  waited for: all_reduce #57 on the data-parallel group (dp) [0, 1, 2], by rank 0 for 8 s",
        "  never arrived: rank 1",
    ]
    assert "  rank 0 (pid 100, host node0), after iteration 40:" in lines
    assert (
        "    last collectives (flight recorder): all_reduce #57 on the data-parallel group (dp) [0, 1, 2] "
        "(not finished)" in lines
    )
    assert "        handle.wait()" in lines and "        f.read()" in lines
    assert "  rank 1: stopped (SIGSTOP or Ctrl-Z): no stack" in lines
    assert (
        "    last collectives entered, by its last heartbeat: #56 on the data-parallel group (dp) [0, 1, 2]"
        in lines
    )
    assert "Traceback" not in text  # the functional tests count torchrun's own


def test_a_part_travels_through_the_store_as_json():
    part = Part(1, 7, "h", None, ["x"], [], {"3": [1, 1]}, NAMES)
    assert Part.from_json(part.to_json()) == part


def test_the_lost_ranks_line_takes_the_collective_it_was_waited_for_in():
    loss = Loss(
        1, "rank 1 (pid 7, host h) stopped responding 9 s ago", "no rank waits longer than X: the job stops"
    )
    assert (
        loss.message
        == "rank 1 (pid 7, host h) stopped responding 9 s ago; no rank waits longer than X: the job stops"
    )
    clause = "rank 0 waited 8 s for it in all_reduce #57 on the data-parallel group (dp) [0, 1]"
    assert loss.waited(clause).message == (
        f"rank 1 (pid 7, host h) stopped responding 9 s ago; {clause}; no rank waits longer than X: the job stops"
    )


def test_the_report_file_goes_to_the_directory(tmp_path):
    where = hang_report.write_report("text\n", str(tmp_path / "save"))
    assert where.startswith(str(tmp_path / "save" / "hang_report_")) and open(where).read() == "text\n"
    assert hang_report.write_report("x", "/proc/no/such/dir").startswith("not written to /proc/no/such/dir/")


def test_the_slowest_ranks_are_named_against_the_median():
    line = straggler_line(20, [(0.100, 0.30), (0.105, 0.30), (0.250, 0.31), (0.098, 0.30)])
    assert line == (
        "stragglers at iteration 20: busy time per iteration, slowest rank 2 250.0 ms (2.44x) vs the median "
        "102.5 ms (fastest rank 3 98.0 ms); wall time per iteration 300.0-310.0 ms"
    )
    # Nobody slow: the slowest is still named, with its ratio.
    assert "slowest rank 1 101.0 ms (1.00x)" in straggler_line(1, [(0.1, 0.2), (0.101, 0.2)])


def test_the_flight_recorder_numbers_are_keyed_by_the_groups_name():
    """In a process of its own (the recorder's size is read when the first backend starts): the
    recorder's status is keyed by a per-process id, translated to the group's name, which all ranks
    share; the entries give the operation."""
    code = textwrap.dedent(
        """
        import socket, torch, torch.distributed as dist
        from megatron.training import hang_report
        hang_report.enable_flight_recorder()
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        a, b = dist.new_group([0]), dist.new_group([0])
        for _ in range(3):
            dist.all_reduce(torch.ones(2), group=b)
        dist.broadcast(torch.ones(2), 0, group=a)
        seqs = hang_report.sequence_numbers()
        assert hang_report.recording()
        # entered; the completion is counted by gloo's own thread, a moment after the call returns
        assert seqs[b.group_name][0] == 3 and seqs[a.group_name][0] == 1, seqs
        assert hang_report.op_of(hang_report.entries(), b.group_name, 3) == "all_reduce"
        assert hang_report.lookup_group(a.group_name, {}) == [f"process group {a.group_name}", [0]]
        print("ok")
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}  # this checkout's megatron, whatever is installed
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_flags_reach_the_configs():
    from megatron.training.arguments import parse_run_config

    tiny = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--lr 1e-3 --mock-data --vocab-size 128"
    ).split()
    cfg = parse_run_config([*tiny, "--train-iters", "1"])
    t = cfg.training
    assert (t.distributed_timeout_seconds_after_init, t.flight_recorder_dump_on_timeout) == (None, True)
    assert cfg.logger.log_straggler is False
    for spelling in ("--disable-flight-recorder-dump-on-timeout", "--no-flight-recorder-dump-on-timeout"):
        flags = [*tiny, "--train-iters", "1", spelling, "--distributed-timeout-seconds-after-init", "30"]
        cfg = parse_run_config([*flags, "--log-straggler"])
        assert cfg.training.flight_recorder_dump_on_timeout is False
        assert cfg.training.distributed_timeout_seconds_after_init == 30 and cfg.logger.log_straggler
