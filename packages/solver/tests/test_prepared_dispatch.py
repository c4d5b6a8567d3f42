"""A dispatch solved in one process and adopted by another: `prepare_dispatch` / `adopt_dispatch`."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle

import pytest

import magi_solver.choice as choice_mod
from magi_solver import (
    PlanOptions,
    PreparedDispatch,
    adopt_dispatch,
    dispatch_choice,
    plan_attention,
    prepare_dispatch,
)
from magi_solver.builders import make_family_mask
from magi_solver.choice import clear_dispatch_cache


def _mask(seed: int, total: int = 4096):
    return tuple(make_family_mask("short_docs_causal", total, seed))


def _prepare_in_worker(seed: int) -> bytes:
    q, k, t = _mask(seed)
    return pickle.dumps(prepare_dispatch(q, k, t, 4096, 4))


@pytest.fixture(autouse=True)
def _clean_cache():
    clear_dispatch_cache()
    yield
    clear_dispatch_cache()


def test_adopted_dispatch_is_taken_without_solving(monkeypatch) -> None:
    # solved in a spawned process, as a data-loader worker would
    with mp.get_context("spawn").Pool(1) as pool:
        prepared = pickle.loads(pool.apply(_prepare_in_worker, (3,)))
    assert isinstance(prepared, PreparedDispatch)
    q, k, t = _mask(3)
    fresh_choice, fresh_plan = dispatch_choice(q, k, t, 4096, 4)
    assert (prepared.choice, prepared.plan) == (fresh_choice, fresh_plan)  # a pure function of the request
    clear_dispatch_cache()
    adopt_dispatch(prepared)

    def no_solve(*args, **kwargs):
        raise AssertionError("solved again although a prepared dispatch was adopted")

    monkeypatch.setattr(choice_mod, "_choose", no_solve)
    choice, plan = dispatch_choice(q, k, t, 4096, 4)
    assert plan is prepared.plan and choice == fresh_choice
    dist_plan = plan_attention(q, k, t, 4096, 4, options=PlanOptions(dispatch_alg=None, overlap_degree=1))
    assert dist_plan.dispatch is prepared.plan
    # another request (another cp size) is not answered by it
    with pytest.raises(AssertionError, match="solved again"):
        dispatch_choice(q, k, t, 4096, 2)


def test_prepared_dispatch_answers_only_its_request() -> None:
    q, k, t = _mask(5)
    prepared = prepare_dispatch(q, k, t, 4096, 4, dispatch_alg="documents")
    other = _mask(6)
    clear_dispatch_cache()
    adopt_dispatch(prepared)
    # a different mask, or the same mask with another algorithm, is solved as before
    assert dispatch_choice(*other, 4096, 4, dispatch_alg="documents")[1] is not prepared.plan
    assert dispatch_choice(q, k, t, 4096, 4, dispatch_alg="min_heap")[1] is not prepared.plan
    assert dispatch_choice(q, k, t, 4096, 4, dispatch_alg="documents")[1] is prepared.plan
    # told the caller's cp size and tokens, it refuses one solved for others, naming them
    adopt_dispatch(prepared, cp_size=4, total_seqlen=4096)
    with pytest.raises(ValueError, match="cp size 4, but the cp group has 2"):
        adopt_dispatch(prepared, cp_size=2)
    with pytest.raises(ValueError, match="4096 tokens, but this batch has 4000"):
        adopt_dispatch(prepared, total_seqlen=4000)


def test_prepare_checks_like_dispatch_choice() -> None:
    q, k, t = _mask(1)
    with pytest.raises(ValueError, match="cp_size"):
        prepare_dispatch(q, k, t, 4096, 0)
    with pytest.raises(ValueError, match="dispatch_alg"):
        prepare_dispatch(q, k, t, 4096, 2, dispatch_alg="nope")


def test_adopt_refuses_what_is_not_a_solved_request() -> None:
    q, k, t = _mask(2)
    prepared = prepare_dispatch(q, k, t, 4096, 4)
    with pytest.raises(TypeError, match="prepared"):
        adopt_dispatch((prepared.choice, prepared.plan))
    wrong_cp = dataclasses.replace(prepared, request=(*prepared.request[:2], 8, *prepared.request[3:]))
    with pytest.raises(ValueError, match="does not answer its request"):
        adopt_dispatch(wrong_cp)
    with pytest.raises(ValueError, match="no solved request"):
        adopt_dispatch(dataclasses.replace(prepared, request=("x",)))


def test_adopting_what_is_cached_keeps_the_cached_plan() -> None:
    q, k, t = _mask(4)
    _, plan = dispatch_choice(q, k, t, 4096, 4)
    adopt_dispatch(pickle.loads(pickle.dumps(prepare_dispatch(q, k, t, 4096, 4))))
    assert dispatch_choice(q, k, t, 4096, 4)[1] is plan
