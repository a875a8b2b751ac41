"""validate.fit.trainer_host_constants: HF Trainer's own host work, from the probes of each call it makes
per step (hf_trainer.TrainerClock), worked by hand."""
import json

import pandas as pd
import pytest

from validate.fit import trainer_host_constants

CAL = {"time": {"host_launch_s_fitted": 1e-5, "host_launch_share": 0.5}}


def row(calls, gas=1, tensors=100, issue_us=None):
    return {"measured_trainer_host_s": json.dumps(calls), "gas": gas, "param_tensors": tensors,
            "measured_step_issue_us": json.dumps(issue_us) if issue_us else float("nan")}


def test_the_trainers_loop_is_the_step_less_the_engines_calls_and_zero_grad():
    a = row({"whole": [0.100, 0.110, 0.120], "loss": [0.02] * 3, "backward": [0.05] * 3, "step": [0.02] * 3,
             "zero_grad": [0.001, 0.002, 0.003], "grad_norm": [0.0001] * 3, "between": [0.001, 0.001, None]})
    # own work per step: 0.100 - (0.09 + 0.001) = 0.009, 0.110 - 0.092 = 0.018, 0.120 - 0.093 = 0.027
    # (grad_norm is the Trainer's: not taken off); median 0.018; zero_grad median 0.002 over 100 tensors
    k = trainer_host_constants(pd.DataFrame([a]), CAL)
    assert k["trainer_s_per_micro_step"] == pytest.approx(0.018)
    assert k["trainer_zero_grad_s_per_tensor"] == pytest.approx(2e-5)
    assert k["trainer_rows"] == 1


def test_a_slow_hosts_probes_bring_it_to_the_fitted_hosts_speed_and_gas_divides_the_loop():
    calls = {"whole": [0.05], "loss": [0.01], "backward": [0.01], "step": [0.01], "zero_grad": [0.001]}
    # launch 1.5x the fitted hosts': h = 1 + 0.5·0.5 = 1.25; loop 0.05 - 0.031 = 0.019 s over 2 micro-steps
    k = trainer_host_constants(pd.DataFrame([row(calls, gas=2, tensors=50, issue_us=[15.0])]), CAL)
    assert k["trainer_s_per_micro_step"] == pytest.approx(0.019 / 2 / 1.25)
    assert k["trainer_zero_grad_s_per_tensor"] == pytest.approx(0.001 / 50 / 1.25)


def test_no_probed_trainer_rows_no_constants():
    assert trainer_host_constants(pd.DataFrame([{"measured_trainer_host_s": float("nan"), "gas": 1}]), CAL) == {}
