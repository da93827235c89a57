"""Properties of any simulation: no overlap on a device, dependencies respected, memory >= 0, determinism."""

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine import simulate
from sim.hardware import FREE_LINK, Link, System, get_system

from conftest import ListWorkload

IDEAL = get_system("ideal")
LINKS = [FREE_LINK, Link("nv", 1e9, 1e-4), Link("pcie", 5e8, 2e-4, shared=True)]


@st.composite
def scenarios(draw):
    layers = draw(st.integers(1, 8))
    stages = draw(st.integers(1, layers))
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1))) \
        if stages > 1 else []
    bounds = [0, *cuts, layers]
    partition = [bounds[i + 1] - bounds[i] for i in range(stages)]
    forward = draw(st.lists(st.floats(1e-4, 1e-2), min_size=layers, max_size=layers))
    link = draw(st.sampled_from(LINKS))
    per_node = draw(st.integers(1, 4))
    return dict(
        workload=ListWorkload(forward, saved_bytes=draw(st.integers(1, 1000)), input_bytes=draw(st.integers(1, 1000))),
        system=System("t", IDEAL.device, per_node, link, Link("ib", 2e8, 5e-4), nodes=-(-stages // per_node)),
        partition=partition,
        batch_size=draw(st.integers(1, 12)),
        microbatches=draw(st.integers(1, 8)),
        checkpoint=draw(st.sampled_from(["always", "except_last", "never"])),
        schedule=draw(st.sampled_from(["gpipe", "1f1b"])),
    )


def _check(result):
    eps = 1e-12
    compute = [r for r in result.timeline.records if r.kind in ("F", "R", "B")]
    for stage in range(len(result.partition)):
        mine = sorted((r for r in compute if r.stage == stage), key=lambda r: r.start_s)
        for before, after in zip(mine, mine[1:]):
            assert after.start_s >= before.end_s - eps, "a device ran two actions at once"
    at = {(r.stage, r.kind, r.microbatch): r for r in compute}
    last = len(result.partition) - 1
    for (stage, kind, m), r in at.items():
        if kind == "F" and stage > 0:
            assert r.start_s >= at[(stage - 1, "F", m)].end_s - eps
        if kind == "B":
            assert r.start_s >= at[(stage, "F", m)].end_s - eps
            if (stage, "R", m) in at:
                assert r.start_s >= at[(stage, "R", m)].end_s - eps
            if stage < last:
                assert r.start_s >= at[(stage + 1, "B", m)].end_s - eps
    assert all(s.bytes >= 0 for s in result.timeline.memory)
    final = {}
    for sample in result.timeline.memory:
        final[sample.stage] = sample.bytes
    assert all(value == 0 for value in final.values()), "memory not released at the end of the step"
    assert 0.0 <= result.bubble_fraction < 1.0


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_simulation_respects_devices_dependencies_and_memory(scenario):
    _check(simulate(**scenario))


@settings(max_examples=40, deadline=None)
@given(scenarios())
def test_same_input_gives_the_same_output(scenario):
    first = simulate(**scenario)
    second = simulate(**scenario)
    assert first.to_dict() == second.to_dict()
    assert first.timeline.to_dict() == second.timeline.to_dict()
