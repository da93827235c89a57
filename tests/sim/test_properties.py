"""Properties of any simulation: no overlap on a device, dependencies respected, memory >= 0, determinism."""

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.catalog.hardware import FREE_LINK, Link, System, get_system
from sim.engine.engine import simulate as simulate_layout
from sim.formats.layout import ParallelLayout

from tests.helpers.scenarios import ListWorkload

IDEAL = get_system("ideal")
LINKS = [FREE_LINK, Link("nv", 1e9, 1e-4), Link("pcie", 5e8, 2e-4, shared=True)]

LAYOUT_KEYS = ("checkpoint", "schedule", "virtual_stages", "replicas", "zero", "placement")


def simulate(workload, system, partition, batch_size, microbatches, record=True, **degrees):
    """A scenario's flat keys simulated: its layout keys made into the layout record."""
    layout = ParallelLayout.for_partition(partition, microbatches, **{k: degrees.pop(k) for k in LAYOUT_KEYS
                                                                      if k in degrees})
    return simulate_layout(workload, system, partition, batch_size, layout, record=record, **degrees)


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
        checkpoint=draw(st.sampled_from(["always", "except_last", "never", "full"])),
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


@st.composite
def scaled_scenarios(draw):
    """D replicas of K devices (V chunks each with the interleaved schedule) over 1-4 devices per node."""
    from sim.engine.placement import PLACEMENTS

    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    virtual = draw(st.integers(2, 3)) if schedule == "interleaved" else 1
    stages = draw(st.integers(1, 3))
    layers = draw(st.integers(virtual * stages, 9))
    parts = virtual * stages
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=parts - 1, max_size=parts - 1))) if parts > 1 else []
    bounds = [0, *cuts, layers]
    replicas = draw(st.integers(1, 3))
    if schedule == "interleaved":  # every replica's micro-batch count a multiple of K
        microbatches = stages * draw(st.integers(1, 3))
        batch = replicas * microbatches * draw(st.integers(1, 2))
    else:
        microbatches = draw(st.integers(1, 6))
        batch = draw(st.integers(replicas, 12))
        from sim.schedules.microbatch import split_rows

        if len(split_rows(batch, replicas)) < replicas:
            batch = replicas
    per_node = draw(st.integers(1, 4))
    link = draw(st.sampled_from(LINKS))
    devices = replicas * stages
    return dict(
        workload=ListWorkload(draw(st.lists(st.floats(1e-4, 1e-2), min_size=layers, max_size=layers)),
                              saved_bytes=draw(st.integers(1, 1000)), input_bytes=draw(st.integers(1, 1000)),
                              param_bytes=draw(st.integers(1, 10**6))),
        system=System("t", IDEAL.device, per_node, link, Link("ib", 2e8, 5e-4), nodes=-(-devices // per_node)),
        partition=[bounds[i + 1] - bounds[i] for i in range(parts)],
        batch_size=batch, microbatches=microbatches,
        checkpoint=draw(st.sampled_from(["always", "except_last", "never", "full"])), schedule=schedule,
        virtual_stages=virtual, replicas=replicas, zero=draw(st.sampled_from([0, 1])) if replicas > 1 else 0,
        placement=draw(st.sampled_from(PLACEMENTS)),
    )


def _check_scaled(result, scenario):
    """No device runs two actions at once; every action follows what it needs, in its own replica."""
    from sim.schedules.microbatch import split_rows
    from sim.engine.placement import replica_and_stage
    from sim.schedules.schedule import build_schedule

    eps = 1e-12
    D, V = scenario["replicas"], scenario["virtual_stages"]
    K = len(scenario["partition"]) // V
    compute = [r for r in result.timeline.records if r.kind in ("F", "R", "B")]
    at = {}
    for device in range(D * K):
        replica, k = replica_and_stage(device, D, K, scenario["placement"])
        rows = split_rows(split_rows(scenario["batch_size"], D)[replica], scenario["microbatches"])
        actions = build_schedule(K, len(rows), scenario["schedule"], scenario["checkpoint"], V)[k]
        mine = sorted((r for r in compute if (r.replica, r.stage) == (replica, k)), key=lambda r: r.start_s)
        assert [(a.kind.value, a.microbatch) for a in actions] == [(r.kind, r.microbatch) for r in mine]
        assert [r.virtual_stage for r in mine] == [a.stage if V > 1 else None for a in actions]
        for before, after in zip(mine, mine[1:]):
            assert after.start_s >= before.end_s - eps, "a device ran two actions at once"
        for action, r in zip(actions, mine):
            at[(replica, action.stage, r.kind, r.microbatch)] = r
    last = V * K - 1
    for (replica, s, kind, m), r in at.items():
        if kind == "F" and s > 0:
            assert r.start_s >= at[(replica, s - 1, "F", m)].end_s - eps
        if kind == "B":
            assert r.start_s >= at[(replica, s, "F", m)].end_s - eps
            if s < last:
                assert r.start_s >= at[(replica, s + 1, "B", m)].end_s - eps
    final = {}
    for sample in result.timeline.memory:
        assert sample.bytes >= 0
        final[sample.stage] = sample.bytes
    assert sorted(final) == list(range(K)) and all(v == 0 for v in final.values())  # replica 0's, as executed
    assert 0.0 <= result.bubble_fraction < 1.0


@settings(max_examples=150, deadline=None)
@given(scaled_scenarios())
def test_replicas_and_interleaving_respect_devices_dependencies_and_memory(scenario):
    _check_scaled(simulate(**scenario), scenario)


@settings(max_examples=150, deadline=None)
@given(scaled_scenarios())
def test_the_planners_bounds_never_exceed_the_simulated_step(scenario):
    from sim.planner.search import Candidate, balanced_bound_s, lower_bound_s
    from sim.engine.stage_costs import CostTable

    result = simulate(**scenario, record=False)
    s = scenario
    candidate = Candidate(len(s["partition"]) // s["virtual_stages"], s["microbatches"], s["checkpoint"],
                          s["schedule"], s["replicas"], s["virtual_stages"], s["zero"], s["placement"])
    table = CostTable(s["workload"], s["system"].device)
    bound = lower_bound_s(table, s["batch_size"], candidate, s["partition"], s["system"])
    assert bound <= result.step_time_s * (1 + 1e-9)
    assert balanced_bound_s(table, s["batch_size"], candidate, s["system"]) <= bound * (1 + 1e-9)
