"""Autoscaling and replica-health settings: every field reaches Ray Serve under its own name, checked."""

from __future__ import annotations

import warnings

import pytest
from ray.serve.config import AutoscalingConfig

from components.serving.config import INGRESS_NAME, AutoscalingSettings, ServingConfig

TUNED = {
    "min_replicas": 2,
    "max_replicas": 6,
    "initial_replicas": 3,
    "target_ongoing_requests": 3.0,
    "upscale_delay_s": 5.0,
    "downscale_delay_s": 40.0,
    "downscale_to_zero_delay_s": 300.0,
    "look_back_period_s": 12.0,
    "metrics_interval_s": 2.0,
    "upscaling_factor": 0.5,
    "downscaling_factor": 0.25,
    "aggregation_function": "max",
}


def test_every_field_is_a_ray_serve_autoscaling_field_and_reaches_it_unchanged():
    assert set(AutoscalingSettings.model_fields) == set(TUNED)  # the test covers every field
    assert set(TUNED) <= set(AutoscalingConfig.model_fields)
    settings = AutoscalingSettings(**TUNED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Serve flags metrics_interval_s as to be replaced
        ray_config = AutoscalingConfig(**settings.serve_config())
    for name, value in TUNED.items():
        got = getattr(ray_config, name)
        assert (got.value if name == "aggregation_function" else got) == value, name
    assert ray_config.get_upscaling_factor() == 0.5 and ray_config.get_downscaling_factor() == 0.25


def test_defaults_leave_the_optional_fields_to_serve():
    config = AutoscalingSettings().serve_config()
    assert not {"initial_replicas", "upscaling_factor", "downscaling_factor", "downscale_to_zero_delay_s"} & set(config)
    assert config["look_back_period_s"] == 30.0 and config["metrics_interval_s"] == 10.0


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"lookback_period_s": 5}, "lookback_period_s"),  # a misspelt field is an error, not a default
        ({"look_back_period_s": 2, "metrics_interval_s": 2}, "look_back_period_s 2 must be > metrics_interval_s 2"),
        ({"upscaling_factor": 0}, "upscaling_factor"),
        ({"downscale_delay_s": -1}, "downscale_delay_s"),
        ({"aggregation_function": "median"}, "aggregation_function"),
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas 3 > max_replicas 2"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(bad, fragment):
    with pytest.raises(ValueError, match=fragment):
        ServingConfig(autoscaling=bad)


def test_health_settings_reach_both_deployments_and_serve_accepts_them():
    from ray import serve

    cfg = ServingConfig(
        health_check_period_s=2, health_check_timeout_s=30, ingress_replicas=2, max_ongoing_requests=4,
        max_queued_requests=4, autoscaling={"max_replicas": 3, "target_ongoing_requests": 2},
    )  # fmt: skip
    model, ingress = cfg.deployment_options(), cfg.ingress_options()
    assert (model["health_check_period_s"], model["health_check_timeout_s"]) == (2, 30)
    assert ingress["name"] == INGRESS_NAME and ingress["num_replicas"] == 2
    assert ingress["ray_actor_options"] == {"num_cpus": 0}  # no model: it must not take a replica's CPUs
    # the two ingress replicas together take all that 3 model replicas of 2 * 4 + 4 may be sent, plus probes
    assert 2 * (ingress["max_ongoing_requests"] - 16) >= 3 * model["max_ongoing_requests"]

    @serve.deployment
    class Probe:
        pass

    for options in (model, ingress):
        deployment = Probe.options(**options)
        assert deployment.max_ongoing_requests == options["max_ongoing_requests"]
    assert Probe.options(**model)._deployment_config.health_check_period_s == 2
