"""schemas.parallelism: the one statement of how a batch and the model spread over a
replica's hosts and devices, checked against the arithmetic it stands for."""

import itertools

from actx.schemas import parallelism


def test_the_rules_refuse_exactly_the_splits_that_do_not_divide():
    for batch, hosts, devices, model in itertools.product(range(1, 13), (1, 2, 3),
                                                          (1, 2, 4, 8), (1, 2, 3, 4, 16)):
        data = parallelism.data_parallel(hosts * devices, model)
        assert data == (hosts * devices // model if hosts * devices % model == 0 else None)
        assert bool(parallelism.model_parallel_problem(model, devices)) == (
            model > devices or devices % model != 0)
        assert bool(parallelism.hosts_problem(batch, hosts)) == (batch % hosts != 0)
        assert bool(parallelism.devices_problem(batch, data)) == (
            data is not None and batch % data != 0)


def test_a_refusal_names_the_numbers_and_what_to_use():
    assert parallelism.devices_problem(12, 16, group="slice", detail="v4-32") == (
        "12 rows per step do not split over the slice's 16 data-parallel devices (v4-32); "
        "use a multiple of 16")
    assert parallelism.model_parallel_problem(3, 4) == "3 does not divide the 4 devices of a host"
    assert "stays within one host" in parallelism.model_parallel_problem(8, 4)
    assert parallelism.hosts_problem(6, 4).endswith("use a multiple of 4")
