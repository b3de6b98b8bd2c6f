"""FLOP accounting per step kind (issue 31): counted with FlopCounterMode through the trainer's own
step (clip/debug, N = 16, chunks of 3 that divide nothing), so the numbers do not depend on the
machine. GradCache and global negatives add at most one no-graph forward of the encoders and the
loss's recompute: at most 4/3 of the plain step plus 8·N²·d. The plain step is a forward and its
backward: 3 forwards' FLOPs, within the loss's terms."""

from __future__ import annotations

from benchmarks.step_flops import account


def test_every_step_kind_within_four_thirds_of_plain_plus_the_loss() -> None:
    rows = {row["kind"]: row for row in account("debug", batch=16, chunk=3)}
    for kind in ("gradcache", "global"):
        assert rows[kind]["within"], rows[kind]
        assert rows[kind]["flops"] >= rows["plain"]["flops"] * 0.999, rows[kind]  # nothing is skipped either
    plain = rows["plain"]
    assert 2.9 <= plain["x_forward"] <= 3.1, plain  # forward + backward (2 forwards' worth), the loss aside
    # GradCache in chunks of 3 of 16: the first pass forwards all 16 without a graph, the re-forward all but
    # the kept last chunk (1 sample): 3 + 15/16 forwards
    assert abs(rows["gradcache"]["x_forward"] - (3 + 15 / 16)) < 0.1, rows["gradcache"]
