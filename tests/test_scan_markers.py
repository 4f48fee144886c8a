"""benchmarks.scan_markers, a probe for the scan-based design (README, Compile time): fsdp-compile's
markers inside a scan's body on 2 gloo ranks give the gradients of an unsharded loop; the scan keeps
every block's gathered weight for backward unless the body's unshards are tagged must-recompute, and
then its backward body gathers again; a prefetch carried from one iteration to the next keeps them
whatever the tags."""

from __future__ import annotations

import pytest

from benchmarks import scan_markers

BLOCKS, DIM = 3, 8


@pytest.mark.parametrize("tag", [False, True], ids=["as-torch-partitions", "unshards-tagged"])
def test_markers_in_a_scan_body(tag: bool) -> None:
    args = scan_markers.parse_args(["--blocks", str(BLOCKS), "--dim", str(DIM)] + (["--tag-unshards"] if tag else []))
    result = scan_markers.run(args)
    forward, backward = result["graphs"]
    assert forward["fsdp_ops"] == {"scan_combine_graph_0": ["fsdp.unshard.default"]}
    gathered = (BLOCKS, DIM, DIM)
    saved = [tuple(shape) for shape in forward["outputs"]]
    assert (BLOCKS, DIM // 2, DIM) in saved or gathered in saved, saved  # the shapes are read as tuples
    if tag:  # the shards are saved and backward gathers again: resharded after forward
        assert gathered not in saved and (BLOCKS, DIM // 2, DIM) in saved, saved
        assert backward["fsdp_ops"] == {"scan_combine_graph_1": ["fsdp.unshard.default", "fsdp.reduce_grad.default"]}
    else:  # torch's own partition keeps every block's gathered weight to backward
        assert gathered in saved, saved
        assert backward["fsdp_ops"] == {"scan_combine_graph_1": ["fsdp.reduce_grad.default"]}
    assert result["grad_error"] < 1e-5


def test_a_carried_prefetch_keeps_every_gathered_weight() -> None:
    """Gathering block i+1 in iteration i and carrying it: exact, but a carry is a body input, which
    the scan saves per iteration whatever the tags, so resharding needs a backward loop of our own."""
    args = scan_markers.parse_args(["--blocks", str(BLOCKS), "--dim", str(DIM), "--prefetch", "--tag-unshards"])
    result = scan_markers.run(args)
    forward, _ = result["graphs"]
    assert (BLOCKS, DIM, DIM) in [tuple(shape) for shape in forward["outputs"]], forward
    assert result["grad_error"] < 1e-5


def test_rows_must_split_evenly() -> None:
    with pytest.raises(SystemExit):
        scan_markers.parse_args(["--dim", "7", "--ranks", "2"])
