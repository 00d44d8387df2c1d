"""ciuic.dist.Collective without a process group: every call is local, errors stay readable."""

from __future__ import annotations

import pytest

from ciuic.distributed.collective import Collective
from ciuic.errors import RankError


def test_a_single_process_collective_is_local() -> None:
    c = Collective()
    assert not c.enabled and c.rank == 0 and c.world_size == 1 and c.coordinator
    assert c.all_gather({"a": [1, 2]}) == [{"a": [1, 2]}]
    assert c.gather("x") == ["x"]
    assert c.broadcast([1, "two"]) == [1, "two"]
    assert c.start_max([3, -1])() == [3, -1]
    assert c.run("answer", lambda: 42) == 42
    c.agree("nothing wrong", None)
    c.close()


def test_a_single_process_keeps_its_own_exception_and_names_failed_ranks() -> None:
    c = Collective()

    def boom() -> None:
        raise KeyError("the original")

    with pytest.raises(KeyError, match="the original"):
        c.run("step", boom)
    with pytest.raises(RankError, match=r"save failed on 1 rank.*rank 0: disk full") as e:
        c.agree("save", "disk full")
    assert e.value.failures == {0: "disk full"}
