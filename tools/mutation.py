"""Mutation testing: break the code on purpose in a scratch copy and see the tests fail.

``python tools/mutation.py named`` applies each mutation of :data:`NAMED` (faults the suite once
let pass) to its own scratch copy of the checkout and runs the default tests meant to catch it;
every one must fail. ``python tools/mutation.py sweep [--modules ...]`` runs cosmic-ray
(``pip install -e '.[mutation]'``) over the modules that carry the project's claims
(:data:`SWEEP`), each with the default tests that exercise it, and prints killed / survived per
module. Both write a Markdown table to ``results/mutation/`` and never touch the checkout itself:
mutants live in copies (the ranks a test spawns import the mutated copy through ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "mutation"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # file, relative to the repository root
    old: str  # text replaced (must occur exactly once)
    new: str
    tests: tuple[str, ...]  # pytest node ids (default tests) expected to fail


_STARTUP = "tests/unit/test_search_startup.py"  # the start-up on a large space, against listing it
NAMED = (
    Mutation("the driver's random escape lists the whole space", "slapo_tune/search/_strategies.py",
             "    for _ in range(RANDOM_WALKS):", "    for _ in range(0):",
             ("tests/unit/test_random_unknown.py::test_a_large_space_gives_a_legal_untried_point_without_being_listed",)),
    Mutation("the driver's random escape returns a point already tried", "slapo_tune/search/_strategies.py",
             "        if point_key(point) not in tried:", "        if True:",
             ("tests/unit/test_random_unknown.py::test_the_last_untried_point_is_found_and_none_once_all_are_tried",)),
    Mutation("the driver's random escape walks a small space too (recorded searches no longer replay)",
             "slapo_tune/search/_strategies.py", "    if space.count() > LISTED_POINTS:", "    if True:",
             ("tests/unit/test_random_unknown.py::"
              "test_a_small_space_draws_uniformly_among_the_points_left_as_recorded_searches_were_seeded",)),
    Mutation("FSDP's prefetched traffic never hidden behind compute on a GPU", "slapo_tune/cost_model/_time.py",
             "FSDP_OVERLAP = 1.0", "FSDP_OVERLAP = 0.0",
             ("tests/unit/test_time_model.py::test_published_runs_fit_and_are_predicted_within_15_percent",)),
    Mutation("a GPU's small linear products run at the large-product rate", "slapo_tune/cost_model/_time.py",
             "    if linear and hw.gemm_half_dim:", "    if False:",
             ("tests/unit/test_time_model.py::test_a_linear_layers_product_reaches_less_of_the_rate_the_smaller_it_is",
              "tests/unit/test_time_model.py::test_published_runs_fit_and_are_predicted_within_15_percent")),
    Mutation("a causal decoder's fused attention charged the whole s x s", "slapo_tune/cost_model/_time.py",
             "    return choose(layout.causal & ((cp == 1) | chunked), causal, s / cp * s)", "    return s / cp * s",
             ("tests/unit/test_time_model.py::"
              "test_a_causal_decoders_fused_attention_is_charged_the_causal_masks_kept_pairs",)),
    Mutation("every non-gated activation counted as GPT-2's composition", "slapo_tune/cost_model/_time.py",
             '    name = layout.activation or ("silu" if layout.gated_mlp else "gelu_new")',
             '    name = "silu" if layout.gated_mlp else "gelu_new"',
             ("tests/unit/test_time_model.py::test_an_activation_counts_the_passes_of_the_ops_it_runs",)),
    Mutation("FSDP's per-block cost not charged on GPUs", "slapo_tune/cost_model/_time.py",
             "    per_block = (choose(level >= 2, 1, 0) if waits else 0) if gpu else 1 + calls",
             "    per_block = 0 if gpu else 1 + calls",
             ("tests/unit/test_time_model.py::test_published_runs_fit_and_are_predicted_within_15_percent",
              "tests/unit/test_fsdp_host.py::test_only_an_fsdp_that_waits_per_unit_pays_the_hosts_per_block_time")),
    Mutation("every FSDP makes the host wait per unit (our FSDP2 charged FSDP1's rate limiter)",
             "slapo_tune/cost_model/_time.py",
             "    waits = runtime.fsdp_host is FsdpHost.WAITS_PER_UNIT", "    waits = True",
             ("tests/unit/test_fsdp_host.py::test_only_an_fsdp_that_waits_per_unit_pays_the_hosts_per_block_time",
              "tests/unit/test_time_model.py::test_published_runs_fit_and_are_predicted_within_15_percent")),
    Mutation("published runs predicted as our runtime runs them (llm-foundry's FSDP1 rate limiter left out)",
             "benchmarks/published_runs.py",
             "    model = CostModel(problem, hw, layout=layout_of_run(problem), runtime=runtime_of(run))",
             "    model = CostModel(problem, hw, layout=layout_of_run(problem))",
             ("tests/unit/test_time_model.py::test_published_runs_fit_and_are_predicted_within_15_percent",)),
    Mutation("a GPU's all-reduce always a ring, never NCCL's tree", "slapo_tune/cost_model/_time.py",
             '    if kind == "all_reduce" and not hw.cores:', "    if False:",
             ("tests/unit/test_time_model.py::test_an_all_reduce_on_gpus_takes_the_tree_when_it_is_faster",)),
    Mutation("a node drives a NIC per device whatever it has", "slapo_tune/cost_model/hardware.py",
             "        nics = self.nics_per_node or self.devices_per_node", "        nics = self.devices_per_node",
             ("tests/unit/test_time_model.py::test_a_node_drives_no_more_nics_than_it_has",)),
    Mutation("the prediction's tracker ignores every allocation in backward", "slapo_tune/cost_model/_tracker.py",
             "                        tracker._add(t, category)",
             "                        if category != \"backward\":\n                            tracker._add(t, category)",
             ("tests/multirank/test_cost_model.py::test_exact_mode_matches_a_measured_real_step",
              "tests/multirank/test_cost_model.py::test_the_prediction_tracker_and_torch_memtracker_agree_on_real_steps")),
    Mutation("exact mode materialises the causal mask a real SDPA step does not",
             "slapo_tune/cost_model/exact.py", "fake_friendly_optimizers(), fake_mask_decisions(), \\",
             "fake_friendly_optimizers(), \\",
             ("tests/multirank/test_cost_model.py::test_exact_mode_matches_a_measured_real_step",)),
    Mutation("exact mode's pipeline works let go of their buffers at once", "slapo_tune/cost_model/exact.py",
             "_static_pipeline_warmup(), _works_hold_their_tensors(), _backend_temporaries(backend), \\",
             "_static_pipeline_warmup(), _backend_temporaries(backend), \\",
             ("tests/multirank/test_cost_model.py::test_exact_mode_matches_a_measured_real_step",)),
    Mutation("analytic pruning keeps no margin", "slapo_tune/cost_model/__init__.py",
             "        if pred.lower > budget:", "        if pred.peak > budget:",
             ("tests/unit/test_search.py::test_analytic_pruning_never_discards_a_point_measured_to_fit",)),
    Mutation("training ignores the schedule's precision", "slapo_tune/runtime.py",
             '        if self.precision.autocast is not None:', '        if False:',
             ("tests/e2e/test_train.py::test_a_bf16_schedule_trains_under_autocast",)),
    Mutation("a schedule file's unknown precision is accepted", "slapo_tune/schedule_file.py",
             '    if data["precision"] not in PRECISIONS:', '    if False:',
             ("tests/e2e/test_train.py::test_bad_schedule_is_one_line_exit_2",
              "tests/e2e/test_train.py::test_malformed_schedule_files_are_refused_by_train_and_valid_ones_run")),
    Mutation("the driver forgets the points in flight", "slapo_tune/search/_driver.py",
             "            if key in known.status or key in known.running or not holds(self.study, trial.number, key):",
             "            if key in known.status:",  # (the reservation alone also keeps its own points in flight)
             ("tests/unit/test_search.py::test_a_sampler_repeating_a_running_point_does_not_launch_it_twice",
              "tests/unit/test_search.py::test_no_point_twice_and_pruned_points_never_launched")),
    Mutation("a trial's constraint set by Optuna's public set_constraint (optuna-dashboard shows it feasible)",
             "slapo_tune/search/_constraints.py",
             "    trial.storage.set_trial_system_attr(trial._trial_id, _CONSTRAINTS_KEY, (value,))",
             "    trial.set_constraint(\"0\", value)",
             ("tests/unit/test_search.py::test_a_recorded_constraint_is_the_one_optuna_and_optuna_dashboard_read",)),
    Mutation("a tuner opens its study when built (its constructor writes the storage)", "slapo_tune/search/_driver.py",
             "        self._study: Study | None = None\n", "        self._study: Study | None = None\n        self.open()\n",
             ("tests/unit/test_journal.py::test_building_a_tuner_touches_no_storage_and_opening_it_does",)),
    Mutation("resume never re-queues an interrupted trial", "slapo_tune/search/_driver.py",
             '                if point and t.number not in retried and "retry_of" not in t.user_attrs:\n'
             "                    self._queue_retry(study, t.number, point)",
             "                pass",
             ("tests/e2e/test_faults.py::test_resume_requeues_the_interrupted_trial_and_keeps_every_finished_result",)),
    Mutation("data parallelism sums full gradient buckets instead of averaging them", "slapo_tune/parallel/_data_parallel.py",
             "            flat /= size", "            if g is None:\n                flat /= size",
             ("tests/multirank/test_templates_verify.py::test_data_parallel_averages_every_full_gradient_bucket",)),
    Mutation("the tied head's gradient is not summed across pipeline stages", "slapo_tune/runtime.py",
             "        if topo.pp > 1 and info.tied:", "        if False:",
             ("tests/multirank/test_parallel_3d.py::test_every_case_verifies",)),
    Mutation("master weights keep only the last micro-batch's gradient", "slapo_tune/_master_weights.py",
             "        if master.grad is None:", "        if True:",
             ("tests/multirank/test_templates_verify.py::test_zero_levels_and_bf16_parameters_verify_at_world_4",)),
    Mutation("replicated bf16 data parallelism averages the bf16 gradients, not the fp32 masters'",
             "slapo_tune/runtime.py",
             "        if topo.dp > 1 and self.model.zero == 0:\n            average_gradients(stepped, topo.dp_group)",
             "        if topo.dp > 1 and self.model.zero == 0:\n"
             "            average_gradients(list(self.model.parameters()), topo.dp_group)",
             ("tests/multirank/test_templates_verify.py::test_zero_levels_and_bf16_parameters_verify_at_world_4",)),
    Mutation("autocast caches cast weights under FSDP", "slapo_tune/runtime.py",
             "cache_enabled=not self.model.zero)", "cache_enabled=True)",
             ("tests/multirank/test_templates_verify.py::test_zero_levels_and_bf16_parameters_verify_at_world_4",)),
    Mutation("the stand-ins for earlier stages embed in fp32 under bf16", "slapo_tune/schedule/_pipeline.py",
             "            module.dtype = dtype", "            pass",
             ("tests/multirank/test_templates_verify.py::test_zero_levels_and_bf16_parameters_verify_at_world_4",)),
    Mutation("bf16 training steps the bf16 parameters, not the fp32 masters", "slapo_tune/session.py",
             "        self.optimizer = default_optimizer(self.trained_parameters().values(),",
             "        self.optimizer = default_optimizer(self.stage.parameters(),",
             ("tests/e2e/test_train.py::test_a_bf16_parameter_schedule_trains_with_fp32_masters_and_resumes",)),
    Mutation("ZeRO-1 reduce-scatters every micro-batch (as level 2)", "slapo_tune/runtime.py",
             "            if self.model.zero == 1:", "            if False:",
             ("tests/multirank/test_zero.py::test_each_level_gathers_and_reduces_as_often_as_zero_says",)),
    Mutation("ZeRO-1 is one FSDP unit for the stage (every bf16 gradient alive until the backward ends)",
             "slapo_tune/parallel/_data_parallel.py", "    for block in blocks:\n", "    for block in blocks if level >= 2 else ():\n",
             ("tests/multirank/test_zero.py::test_zero1_upcasts_each_blocks_bf16_gradients_as_its_backward_ends",)),
    Mutation("the cost model's one-stage ZeRO-1 reduces every micro-batch (level 2's memory, not deferred)",
             "slapo_tune/cost_model/_stage.py", "deferred = sharded and accumulating and (pipelined or level == 1)",
             "deferred = sharded and accumulating and pipelined",
             ("tests/multirank/test_cost_model.py::test_llama70b_gradients_and_gathered_weights_follow_the_zero_level_and_the_pipeline",)),
    Mutation("the cost model keeps a deferred backward's bf16 gradients until it ends (one unit's upcast)",
             "slapo_tune/cost_model/_stage.py", '        current = {"grads_unsharded": (block + head) * Pb}\n        if not accumulated:',
             '        current = {"grads_unsharded": made * Pb}\n        if not accumulated:',
             ("tests/multirank/test_cost_model.py::test_llama70b_gradients_and_gathered_weights_follow_the_zero_level_and_the_pipeline",)),
    Mutation("ZeRO-3 reshards the root after forward (gathered again at once for the head's backward)",
             "slapo_tune/parallel/_data_parallel.py", "    fully_shard(stage, reshard_after_forward=False, **options)",
             "    fully_shard(stage, reshard_after_forward=level == 3, **options)",
             ("tests/multirank/test_zero.py::test_each_level_gathers_and_reduces_as_often_as_zero_says",)),
    Mutation("a rank's peak RSS is ru_maxrss (on Linux it survives exec: the launcher's peak)", "slapo_tune/launch.py",
             '                if line.startswith("VmHWM:"):', '                if line.startswith("no such line"):',
             ("tests/e2e/test_faults.py::test_a_process_exec_from_a_large_launcher_reports_its_own_peak",
              "tests/e2e/test_faults.py::test_trial_leaking_memory_and_threads_does_not_reach_the_next")),
    Mutation("verify compares only the first ten gradients", "slapo_tune/_verify.py",
             "    for name, param in model.named_parameters():",
             "    for name, param in list(model.named_parameters())[:10]:",
             ("tests/multirank/test_tensor_parallel.py::test_tensor_parallel_matches_unscheduled",)),
    Mutation("calibration fits nothing (the default weights come back)", "slapo_tune/cost_model/calibration.py",
             "        x = nnls(a, b)", "        x = np.array([DEFAULT_WEIGHTS[k] for k in columns])",
             ("tests/unit/test_calibration_fit.py::test_the_fit_recovers_what_the_default_weights_miss",
              "tests/multirank/test_cost_model.py::test_calibration_improves_held_out_points_and_is_cached")),
    Mutation("a step one rank waited through is re-measured on that rank alone", "slapo_tune/session.py",
             "            dist.all_reduce(busy, op=dist.ReduceOp.MAX)", "            pass",
             ("tests/multirank/test_session.py::test_a_step_one_rank_waited_through_is_measured_again_on_every_rank",)),
    Mutation("a published run on a GPU no fitted run used counted as validated", "benchmarks/published_runs.py",
             '    fitted_hardware = {r["hardware"] for r in runs if not r["held_out"]}',
             '    fitted_hardware = {r["hardware"] for r in runs}',
             ("tests/unit/test_published_runs.py::test_runs_on_a_gpu_no_fitted_run_used_are_summarised_apart",)),
    Mutation("benchmarks take the median over the runs that reached the target only", "benchmarks/_stats.py",
             "    ordered = sorted(math.inf if v is None else v for v in values)",
             "    ordered = sorted(v for v in values if v is not None)",
             ("tests/unit/test_benchmark_stats.py::test_a_run_that_missed_counts_as_worse_than_every_run_that_reached",)),
    Mutation("benchmark variants always run in the same order", "benchmarks/_stats.py",
             "        rng.shuffle(order)", "        pass",
             ("tests/unit/test_benchmark_stats.py::test_variants_run_in_a_shuffled_order_that_every_rank_draws_alike",)),
    # the accuracy benchmark's --points file
    Mutation("the accuracy benchmark measures a --points file's illegal point", "benchmarks/cost_model_accuracy.py",
             "    except UsageError as exc:\n        return str(exc)\n    return None",
             "    except UsageError:\n        return None\n    return None",
             ("tests/unit/test_accuracy_points.py::test_a_points_file_keeps_its_legal_points_in_the_spaces_knob_order_and_says_why_it_dropped_the_others",)),
    Mutation("the accuracy benchmark takes a --points file's 1.0 or True for a knob of ints",
             "benchmarks/cost_model_accuracy.py", "        if type(spelled) is not type(value):", "        if False:",
             ("tests/unit/test_accuracy_points.py::test_a_points_file_keeps_its_legal_points_in_the_spaces_knob_order_and_says_why_it_dropped_the_others",)),
    Mutation("the accuracy benchmark keeps a --points file's knob order", "benchmarks/cost_model_accuracy.py",
             "                point = {name: point[name] for name in space.names}", "                point = dict(point)",
             ("tests/unit/test_accuracy_points.py::test_a_points_file_keeps_its_legal_points_in_the_spaces_knob_order_and_says_why_it_dropped_the_others",)),
    Mutation("the accuracy benchmark calibrates on a --points file's evaluated point", "benchmarks/cost_model_accuracy.py",
             '                if point in kept["evaluated"] or point in kept[role]:', "                if point in kept[role]:",
             ("tests/unit/test_accuracy_points.py::test_a_malformed_points_file_is_one_line_and_exit_status_2",)),
    Mutation("the accuracy benchmark reads a --points file of any number of points", "benchmarks/cost_model_accuracy.py",
             "    if sum(len(pts) for *_, lists in entries for pts in lists.values()) > MAX_POINTS:", "    if False:",
             ("tests/unit/test_accuracy_points.py::test_a_malformed_points_file_is_one_line_and_exit_status_2",)),
    Mutation("the accuracy benchmark reads a --points file of up to 4 MiB", "benchmarks/cost_model_accuracy.py",
             '    data = read_json_file(path, "points file", limit=MAX_POINTS_BYTES)',
             '    data = read_json_file(path, "points file")',
             ("tests/unit/test_accuracy_points.py::test_a_malformed_points_file_is_one_line_and_exit_status_2",)),
    Mutation("the accuracy benchmark records its calibration points as evaluated", "benchmarks/cost_model_accuracy.py",
             '    return {label: {str(world): {"evaluated": evaluated, "calibration": calibration}',
             '    return {label: {str(world): {"evaluated": calibration, "calibration": evaluated}',
             ("tests/unit/test_accuracy_points.py::test_a_runs_recorded_points_fed_back_select_the_same_points",)),
    Mutation("the training job steps with a 10 % larger learning rate", "slapo_tune/train.py",
             "                             lr=config.lr)", "                             lr=config.lr * 1.1)",
             ("tests/e2e/test_train.py::test_tuned_schedule_trains_like_the_unscheduled_model",)),
    # what a local run and a Ray trial listen on
    Mutation("the local launcher hosts its rendezvous store on every interface (a TCPStore)", "slapo_tune/launch.py",
             '    store_path = os.path.join(rendezvous, "store")\n',
             '    store_path = os.path.join(rendezvous, "store")\n    import torch.distributed as dist\n'
             '    wildcard = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)\n',
             ("tests/multirank/test_launch.py::test_ranks_listen_on_the_loopback_only",)),
    Mutation("local ranks' gloo listens where the hostname resolves, not on the loopback", "slapo_tune/launch.py",
             "child_env = {**os.environ, **loopback_environment(), ", "child_env = {**os.environ, ",
             ("tests/multirank/test_launch.py::test_ranks_listen_on_the_loopback_only",)),
    Mutation("a launch's rendezvous folder outlives it", "slapo_tune/launch.py",
             "        shutil.rmtree(rendezvous, ignore_errors=True)", "        pass",
             ("tests/multirank/test_launch.py::test_ranks_listen_on_the_loopback_only",
              "tests/multirank/test_launch.py::test_a_raising_rank_is_named_and_the_others_are_killed")),
    Mutation("a Ray trial's store ignores the interface --net-if names", "runners/ray_runner.py",
             "    named = named_interface(environ)\n    if not named:", "    named = None\n    if not named:",
             ("tests/e2e/test_ray_runner.py::test_the_store_listens_on_the_interface_the_user_named_else_at_the_node_address",)),
    # where ranks run (slapo_tune.device): CUDA faked on CPU up to where a kernel would run
    Mutation("the local runner starts GPU trials on gloo", "runners/local.py",
             "backend=setup.backend, gpus=gpus,", 'backend="gloo", gpus=gpus,',
             ("tests/multirank/test_device.py::test_concurrent_local_trials_get_disjoint_gpus",)),
    Mutation("concurrent trials share GPUs", "runners/local.py",
             "            taken, self._free = self._free[:n], self._free[n:]", "            taken = self._free[:n]",
             ("tests/multirank/test_device.py::test_concurrent_local_trials_get_disjoint_gpus",)),
    Mutation("a rank's environment does not name its GPU", "slapo_tune/device.py",
             '    return {"CUDA_VISIBLE_DEVICES": gpu, **NCCL_ENV}', "    return dict(NCCL_ENV)",
             ("tests/multirank/test_device.py::test_launcher_gives_each_rank_its_own_gpu_on_nccl",)),
    Mutation("a rank's GPU is set only once it runs, after CUDA may have started", "slapo_tune/launch.py",
             "            with _started_with(device_env):\n                proc.start()", "            proc.start()",
             ("tests/multirank/test_device.py::test_launcher_gives_each_rank_its_own_gpu_on_nccl",)),
    Mutation("a rank given GPU 1 of CUDA_VISIBLE_DEVICES=4,5 gets GPU 1", "slapo_tune/device.py",
             "    if visible is not None:", "    if False:",
             ("tests/multirank/test_device.py::test_device_setup_decides_kind_backend_and_count",)),
    Mutation("trials in flight ignore that a rank needs a GPU", "slapo_tune/device.py",
             "        if world_size > devices:\n            raise _too_few_gpus(world_size, devices)\n"
             "        return devices // world_size", "        return max(1, devices // world_size)",
             ("tests/multirank/test_device.py::test_trials_in_flight_are_gpus_over_world",)),
    Mutation("Ray GPU bundles hold no GPU", "runners/ray_runner.py",
             '            bundle["GPU"] = 1.0', "            pass",
             ("tests/multirank/test_device.py::test_ray_bundles_hold_one_gpu_per_rank",)),
    Mutation("Ray GPU bundles ask a node for more CPUs than it has per GPU", "runners/ray_runner.py",
             "cpus = _placeable_share(ray, ranks, total / ranks)", "cpus = total / ranks",
             ("tests/multirank/test_device.py::test_ray_bundles_hold_one_gpu_per_rank",)),
    Mutation("the default budget on a GPU keeps no reserve", "slapo_tune/device.py",
             "        return memory - cuda_reserve(memory)", "        return memory",
             ("tests/multirank/test_device.py::test_default_budget_is_the_gpus_memory_less_the_reserve",
              "tests/multirank/test_device.py::test_tune_defaults_on_cuda")),
    Mutation("tune's default precision ignores the device", "slapo_tune/cli/tune.py",
             "    precision = args.precision or default_precision(device)",
             '    precision = args.precision or default_precision("cpu")',
             ("tests/multirank/test_device.py::test_tune_defaults_on_cuda",)),
    Mutation("--device cuda is taken without CUDA", "slapo_tune/device.py", "        if here:", "        if False:",
             ("tests/multirank/test_device.py::test_tune_on_cuda_without_cuda_exits_2_with_one_line",)),
    Mutation("the old --device PRESET spelling gets no pointer to --hardware", "slapo_tune/cli/_common.py",
             "    if requested in PRESETS:", "    if False:",
             ("tests/multirank/test_device.py::test_device_and_hardware_are_apart_on_the_command_line",)),
    Mutation("hardware detection ignores the GPU's name", "slapo_tune/cost_model/hardware.py",
             "    same_model = [key for key, model in PRESET_MODELS.items() if model in lowered]",
             "    same_model = []",
             ("tests/multirank/test_device.py::test_hardware_is_detected_from_the_gpus_name_and_memory",)),
    Mutation("an nccl rank computes on cuda:RANK, a GPU it cannot see", "slapo_tune/launch.py",
             '            device = device_setup("cuda").rank_device()', '            device = f"cuda:{rank}"',
             ("tests/multirank/test_device.py::test_a_launched_nccl_rank_uses_cuda_0_and_a_collective_timeout",)),
    Mutation("a hung NCCL collective waits out the trial's whole limit", "slapo_tune/launch.py",
             "            collectives = collective_timeout(timeout_s)", "            collectives = timeout_s",
             ("tests/multirank/test_device.py::test_a_launched_nccl_rank_uses_cuda_0_and_a_collective_timeout",)),
    Mutation("the root cause is the outermost error", "slapo_tune/launch.py",
             "    chain, seen = [exc], {id(exc)}", "    return exc",
             ("tests/multirank/test_device.py::test_out_of_memory_inside_a_stage_is_oom_on_the_rank_that_hit_it",)),
    Mutation("an OOM in the context of another error is not the cause", "slapo_tune/launch.py",
             "        nxt = last.__cause__ or (None if last.__suppress_context__ else last.__context__)",
             "        nxt = last.__cause__",
             ("tests/multirank/test_device.py::test_out_of_memory_as_the_context_of_another_error_is_the_cause",)),
    Mutation("CUDA's reserved peak is not recorded", "slapo_tune/memory.py",
             ",\n                               reserved=torch.cuda.max_memory_reserved(device))", ")",
             ("tests/multirank/test_device.py::test_cuda_peak_reports_allocated_and_reserved",)),
    Mutation("the GPU check's training run trains one step", "benchmarks/gpu_check.py",
             '"--steps", str(steps), *device_args]', '"--steps", "1", *device_args]',
             ("tests/e2e/test_gpu_check.py::test_gpu_check_smoke_tunes_exports_and_trains_on_cpu",)),
    Mutation("sequence parallelism never sums the partial gradients of norms and row-parallel biases",
             "slapo_tune/runtime.py",
             "            reduce_sequence_partial_gradients(self.model, self.gradient, topo.tp_group)", "            pass",
             ("tests/multirank/test_sequence_parallel.py::test_sequence_parallel_points_verify_on_every_template",)),
    Mutation("the sequence gather's backward keeps this rank's chunk instead of reduce-scattering",
             "slapo_tune/parallel/_comm.py",
             '_GatherReduce = _axis_collective("_GatherReduce", _all_gather, _reduce_scatter)',
             '_GatherReduce = _axis_collective("_GatherReduce", _all_gather, _own_chunk)',
             ("tests/multirank/test_sequence_parallel.py::test_sequence_parallel_points_verify_on_every_template",)),
    Mutation("sequence parallelism saves the gathered inputs of the tensor-parallel regions whole",
             "slapo_tune/parallelize.py", "    if entry is None or entry[0]() is not base:\n        return t",
             "    if True:\n        return t",
             ("tests/multirank/test_sequence_parallel.py::test_sequence_parallel_keeps_a_tp_shard_of_the_replicated_activations",)),
    Mutation("a region's single column-parallel layer never overlaps its backward collectives",
             "slapo_tune/parallelize.py", "                state_of(consumer.mod).compute = overlapped_linear_forward",
             "                pass",
             ("tests/multirank/test_sequence_parallel.py::test_a_single_consumer_overlaps_its_backward_collectives_and_matches_"
              "the_plain_model",)),
    Mutation("the overlapped linear layer keeps the gathered input alive for backward", "slapo_tune/parallelize.py",
             "        ctx.save_for_backward(shard.detach().to(out.dtype), weight)",
             "        ctx.save_for_backward(shard.detach().to(out.dtype), weight)\n        ctx.kept = whole",
             ("tests/multirank/test_sequence_parallel.py::test_sequence_parallel_keeps_a_tp_shard_of_the_replicated_activations",)),
    Mutation("selective recomputation saves nothing (recomputes as full does)", "slapo_tune/schedule/_state.py",
             "    return CheckpointPolicy.MUST_SAVE if op in _SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE",
             "    return CheckpointPolicy.PREFER_RECOMPUTE",
             ("tests/multirank/test_selective_checkpoint.py::test_selective_memory_lies_between_none_and_full_and_exact_mode_"
              "predicts_it", "tests/multirank/test_selective_checkpoint.py::test_selective_recomputes_no_matmul_and_replays_dropout")),
    Mutation("an interleaved pipeline rank holds consecutive stages instead of r, r + pp, ...", "slapo_tune/_partition.py",
             "    return range(rank, stages, pp)",
             "    return range(rank * (stages // pp), (rank + 1) * (stages // pp))",
             ("tests/multirank/test_interleaved.py::test_rank_r_holds_stages_r_and_r_plus_pp",)),
    Mutation("a structural copy loses what the schedule stored on a traced GraphModule", "slapo_tune/schedule/_pipeline.py",
             "        if isinstance(m, fx.GraphModule):", "        if False:",
             ("tests/multirank/test_interleaved.py::test_a_structural_copy_shares_tensors_and_keeps_the_schedule",
              "tests/multirank/test_interleaved.py::test_interleaved_points_verify_at_world_4")),
    Mutation("verify compares only the first of an interleaved rank's stages", "slapo_tune/_verify.py",
             "    for chunk in model.chunks:  # an interleaved pipeline rank holds several stages",
             "    for chunk in model.chunks[:1]:",
             ("tests/multirank/test_interleaved.py::test_interleaved_points_verify_at_world_4",)),
    # the analytic cost model and the three techniques (sp, ckpt_policy, vpp)
    Mutation("the analytic model ignores sequence parallelism", "slapo_tune/cost_model/_memory.py",
             '    sp = tp > 1 and knob_value(point, "sp") == "on"\n    selective = point["ckpt_ratio"] > 0',
             '    sp = False\n    selective = point["ckpt_ratio"] > 0',
             ("tests/unit/test_cost_model_techniques.py::test_sequence_parallelism_keeps_less_by_what_exact_mode_saves",
              "tests/unit/test_cost_model_techniques.py::test_analytic_ratios_move_like_megatrons")),
    Mutation("the activation probe runs sequence parallelism without the training step's shard-saving hooks",
             "slapo_tune/cost_model/_probe.py",
             "            stack.enter_context(sequence_parallel_activations())",
             "            pass",
             ("tests/unit/test_cost_model_techniques.py::test_sequence_parallelism_keeps_less_by_what_exact_mode_saves",)),
    Mutation("the analytic model counts selective checkpointing as full", "slapo_tune/cost_model/_memory.py",
             '    selective = point["ckpt_ratio"] > 0 and knob_value(point, "ckpt_policy") == "selective"',
             "    selective = False",
             ("tests/unit/test_cost_model_techniques.py::test_recomputation_orders_none_selective_full",
              "tests/unit/test_cost_model_techniques.py::test_analytic_peak_is_within_10_percent_of_exact_mode")),
    Mutation("the activation probe measures amp-bf16 without autocast", "slapo_tune/cost_model/_probe.py",
             "            stack.enter_context(torch.autocast(\"cpu\", dtype=autocast))", "            pass",
             ("tests/unit/test_probe_precision.py::test_gpt2_is_measured_in_every_precision_and_amp_is_not_fp32_halved",)),
    Mutation("an interleaved rank holds as many micro-batches as a 1F1B one", "slapo_tune/cost_model/_stage.py",
             "    fresh, held = _each(_flights, pp, schedule, stage, m, vpp)",
             "    fresh, held = _each(_flights, pp, schedule, stage, m)",
             ("tests/unit/test_cost_model_techniques.py::test_interleaving_shrinks_the_bubble_and_holds_more_micro_batches",
              "tests/unit/test_cost_model_techniques.py::test_analytic_peak_is_within_10_percent_of_exact_mode")),
    Mutation("a fused projection's backward re-gather and reduce-scatter never hidden on GPUs",
             "slapo_tune/cost_model/_time.py", '    fused = gpu & (point["fuse"] == "on")', "    fused = False",
             ("tests/unit/test_time_model.py::test_a_fused_projection_hides_its_backward_regather_and_reduce_scatter_"
              "behind_its_products",)),
    Mutation("a fused projection hides its backward collectives whatever they outlast", "slapo_tune/cost_model/_time.py",
             "_min(gather, product) + _min(scatter, product)", "gather + scatter",
             ("tests/unit/test_time_model.py::test_a_fused_projection_hides_its_backward_regather_and_reduce_scatter_"
              "behind_its_products",)),
    Mutation("vpp is offered only where pp * vpp divides the blocks (Megatron's split with the ends one block short "
             "refused)", "slapo_tune/template.py",
             "            return [1, *sorted({*equal, *short_ends})]", "            return [1, *equal]",
             ("tests/unit/test_space.py::test_vpp_offers_equal_chunks_and_megatrons_split_with_the_ends_one_block_short",
              "tests/multirank/test_uneven_pipeline.py::test_interleaved_stages_with_the_ends_one_block_short_verify")),
    Mutation("the short-ends vpp rule also offers pp * vpp beyond the blocks (an end stage of none)",
             "slapo_tune/template.py", "if pp * v <= info.layers] if padded % pp == 0 else []",
             "] if padded % pp == 0 else []",
             ("tests/unit/test_space.py::test_vpp_offers_equal_chunks_and_megatrons_split_with_the_ends_one_block_short",)),
    Mutation("an interleaved rank's micro-batch in flight holds all its blocks (equal chunks assumed)",
             "slapo_tune/cost_model/_schedule_math.py",
             "    return vpp * sum(n * size for n, size in zip(counts, sizes)) / sum(counts)", "    return sum(sizes)",
             ("tests/unit/test_cost_model_techniques.py::test_blocks_in_flight_with_short_end_chunks_are_torchs",)),
    Mutation("an interleaved rank's checkpointed blocks counted over equal chunks", "slapo_tune/cost_model/_schedule_math.py",
             "    return tuple(sum(1 for i in range(*stage_block_range(total_layers, pp * vpp, stage)) if i in chosen)\n"
             "                 for stage in rank_stages(rank, pp, pp * vpp))",
             "    blocks = rank_blocks(total_layers, pp, rank, vpp)\n    chunk = len(blocks) // vpp\n"
             "    return tuple(sum(1 for i in blocks[k * chunk:(k + 1) * chunk] if i in chosen) for k in range(vpp))",
             ("tests/unit/test_cost_model_techniques.py::test_checkpointed_blocks_per_chunk_are_the_built_schedules",)),
    Mutation("an interleaved rank's backward end frees 1 / vpp of a micro-batch whatever its first chunk holds",
             "slapo_tune/cost_model/_schedule_math.py",
             "    return first / blocks_in_flight(total_layers, pp, rank, vpp, micro_batches)", "    return 1 / vpp",
             ("tests/unit/test_cost_model_techniques.py::test_blocks_in_flight_with_short_end_chunks_are_torchs",)),
    Mutation("the interleaved pipeline's bubble is not divided by vpp", "slapo_tune/cost_model/_time.py",
             "    slots = m + (pp - 1) / vpp", "    slots = m + pp - 1",
             ("tests/unit/test_cost_model_techniques.py::test_interleaving_shrinks_the_bubble_and_holds_more_micro_batches",)),
    # signals and exit codes a scheduler acts on
    Mutation("SIGTERM ends a command at once (its default action)", "slapo_tune/cli/_signals.py",
             "    previous = signal.signal(signal.SIGTERM, _on_sigterm)",
             "    previous = signal.getsignal(signal.SIGTERM)",
             ("tests/e2e/test_signals.py::test_sigterm_stops_a_tune_and_its_trials_as_ctrl_c_does",
              "tests/e2e/test_signals.py::test_sigterm_stops_train_and_its_ranks")),
    Mutation("a SIGTERM during cleanup breaks it off", "slapo_tune/cli/_signals.py",
             "    if _State.deferring:", "    if False:",
             ("tests/e2e/test_signals.py::test_sigterm_in_a_deferred_block_takes_effect_at_its_end_and_once",)),
    Mutation("ray.init's SIGTERM handlers stay (sys.exit, a stack dump and abort)", "runners/ray_cluster.py",
             "    with _stderr_to(ray_log), _sigterm_handler_kept():", "    with _stderr_to(ray_log):",
             ("tests/e2e/test_signals.py::test_sigterm_stops_a_tune_on_a_local_ray_head_and_the_head",)),
    Mutation("a local head's processes keep the driver's $TMPDIR (its dashboard leaves pymp-* there)",
             "runners/ray_cluster.py", '    env["TMPDIR"] = str(head_tmp)', "    pass",
             ("tests/e2e/test_signals.py::test_sigterm_stops_a_tune_on_a_local_ray_head_and_the_head",)),
    Mutation("a SIGKILLed driver's multiprocessing folder is never removed", "slapo_tune/launch.py",
             '            remove_orphans(os.path.dirname(tempdir), "pymp-")', "            pass",
             ("tests/e2e/test_signals.py::test_a_sigkilled_drivers_folder_is_removed_by_the_next_run_and_no_other",)),
    Mutation("a folder whose PID now names another process is kept", "slapo_tune/_owned.py",
             "(now == tag or \" \" not in tag)", "(now.split()[0] == tag.split()[0])",
             ("tests/e2e/test_signals.py::test_only_tagged_folders_of_ended_processes_are_removed",)),
    Mutation("a running process's folder is removed", "slapo_tune/_owned.py",
             "        if now is not None and (now == tag", "        if now is None and (now == tag",
             ("tests/e2e/test_signals.py::test_only_tagged_folders_of_ended_processes_are_removed",
              "tests/e2e/test_signals.py::test_a_sigkilled_drivers_folder_is_removed_by_the_next_run_and_no_other")),
    Mutation("a tune with no point that ran ok exits 0", "slapo_tune/cli/tune.py",
             "f\"is in {out / 'trials.csv'}\", file=sys.stderr)\n        return EXIT_NO_RESULT",
             "f\"is in {out / 'trials.csv'}\", file=sys.stderr)\n        return EXIT_OK",
             ("tests/e2e/test_exit_codes.py::test_every_trial_failing_exits_3_with_one_line_naming_the_most_common_failure",)),
    Mutation("a tune whose budget no point fits starts anyway", "slapo_tune/cli/tune.py",
             "    if unfit:  # what every", "    if False:  # what every",
             ("tests/e2e/test_exit_codes.py::test_nothing_fits_exits_3_before_starting_with_one_line_naming_a_budget_that_fits",)),
    Mutation("each pruned point gets a line", "slapo_tune/cli/_live.py",
             "        elif kind == TrialStatus.PRUNED:\n            pass", "        elif False:\n            pass",
             ("tests/e2e/test_what_a_user_sees.py::test_the_plain_lines_say_each_trial_its_result_and_the_best_so_far",)),
    Mutation("the fused RMSNorm's backward forgets that rstd depends on the input", "slapo_tune/op.py",
             "        grad_x = g * rstd + xf * (grad_rstd * (-0.5) * rstd.pow(3) * (2.0 / x.shape[-1]))",
             "        grad_x = g * rstd",
             ("tests/multirank/test_fused_norm_swiglu.py::test_fused_rms_norm_computes_what_llama_rms_norm_does",
              "tests/multirank/test_fused_norm_swiglu.py::test_fuse_on_schedules_fused_norms_and_swiglu_that_verify_on_two_ranks")),
    Mutation("the fused RMSNorm keeps the fp32 copy of a bf16 input", "slapo_tune/op.py",
             "        ctx.save_for_backward(x, rstd, weight)", "        ctx.save_for_backward(xf, rstd, weight)",
             ("tests/multirank/test_fused_norm_swiglu.py::test_a_block_keeps_what_the_fused_kernels_say_less",)),
    Mutation("fuse=on leaves Llama's MLPs to Hugging Face's SwiGLU", "search_spaces/llama.py",
             '    swiglu_mlps = {"model.layers.*.mlp": ("gate_up_proj", "down_proj")}', "",
             ("tests/multirank/test_fused_norm_swiglu.py::test_a_block_keeps_what_the_fused_kernels_say_less",
              "tests/multirank/test_fused_norm_swiglu.py::test_fuse_on_schedules_fused_norms_and_swiglu_that_verify_on_two_ranks")),
    Mutation("a local head this tuner starts gets the study's storage URL", "slapo_tune/cli/tune.py",
             ",\n                      withheld=(STORAGE_ENV,))", ")",
             ("tests/e2e/test_exit_codes.py::test_a_local_head_that_does_not_come_up_is_not_a_usage_error",)),
    Mutation("a local head gets the variables its caller withholds", "runners/ray_cluster.py",
             "os.environ.items() if k not in withheld}", "os.environ.items()}",
             ("tests/e2e/test_ray_runner.py::test_a_local_head_sees_none_of_what_its_caller_withholds",)),
    Mutation("a local head that does not answer in time is a usage error", "runners/ray_cluster.py",
             "                raise InfrastructureError(f\"the local Ray head did not answer",
             "                raise UsageError(f\"the local Ray head did not answer",
             ("tests/e2e/test_exit_codes.py::test_a_local_head_that_does_not_come_up_is_not_a_usage_error",)),
    Mutation("an interleaved pipeline keeps every send until the step ends (torch's retention)",
             "slapo_tune/parallel/_send_release.py",
             "            if (at is not None and self.proof.posted(self.rank, at, action)) or all(",
             "            if False and (at is not None and self.proof.posted(self.rank, at, action)) or all(",
             ("tests/multirank/test_send_release.py::test_peak_lower_by_the_sends_torch_keeps",)),
    Mutation("the receive counts read off one round of micro-batches, before the steady state",
             "slapo_tune/parallel/_send_release.py", "return schedule_bounds(pp, vpp, n_microbatches, schedule)[1][rank]",
             "return _bounds(pp, vpp, min(n_microbatches, pp), schedule)[1][rank]",
             ("tests/unit/test_send_bound.py::test_the_receive_counts_past_two_rounds_are_those_of_the_whole_step",)),
    Mutation("the schedule bounds' file is not named by the walk that found them",
             "slapo_tune/cost_model/_schedule_bounds.py", 'f"schedule-bounds-torch{torch_version}-{walk}.json"',
             'f"schedule-bounds-torch{torch_version}.json"',
             ("tests/unit/test_send_bound.py::test_a_bounds_file_of_another_walk_or_not_of_this_form_is_not_read",)),
    Mutation("the cost model walks torch's schedule again though its file holds the bounds",
             "slapo_tune/cost_model/_schedule_bounds.py", "        if path is not None and path not in _READ:",
             "        if False:",
             ("tests/unit/test_send_bound.py::test_the_cost_models_bounds_are_the_walks_and_a_second_process_reads_them_from_its_file",)),
    Mutation("a bounds file's entries are taken whatever their number of ranks",
             "slapo_tune/cost_model/_schedule_bounds.py", "if len(value[0]) == len(value[1]) == key[0]:",
             "if True:",
             ("tests/unit/test_send_bound.py::test_a_bounds_file_of_another_walk_or_not_of_this_form_is_not_read",)),
    Mutation("an interleaved rank's received gradients go before the weight pass that reads them",
             "slapo_tune/parallel/_send_release.py", '        if kind in ("B", "I", "W"):',
             '        if kind in ("B", "I"):', ("tests/multirank/test_cost_model.py::test_interleaved_receive_buffers_alive_are_read_off_torchs_action_lists",)),
    Mutation("an interleaved rank's receive walk counts the received activations only",
             "slapo_tune/parallel/_send_release.py", 'if kind in ("RECV_F", "RECV_B"):', 'if kind == "RECV_F":',
             ("tests/multirank/test_cost_model.py::test_interleaved_receive_buffers_alive_are_read_off_torchs_action_lists",)),
    Mutation("an interleaved rank's last backward counts the step's most receive buffers",
             "slapo_tune/cost_model/_stage.py", '"pp_sends": sent, "pp_recv": recv_end}',
             '"pp_sends": sent, "pp_recv": hidden_1 * st.receives[0]}', ("tests/multirank/test_cost_model.py::test_interleaved_receive_buffers_alive_are_read_off_torchs_action_lists",)),
    Mutation("an interleaved rank's moments count the receive buffers of its last backward",
             "slapo_tune/cost_model/_stage.py", 'terms.setdefault("pp_recv", knobs.hidden_1 * st.receives[0])',
             'terms.setdefault("pp_recv", knobs.hidden_1 * st.receives[1])', ("tests/multirank/test_cost_model.py::test_interleaved_receive_buffers_alive_are_read_off_torchs_action_lists",)),
    Mutation("the last stage's moment after the loss counts the loss's two gradients only, never the head's backward",
             "slapo_tune/cost_model/_stage.py", "    grad_1 = _pick(fused_loss, head_1, head_after_loss)",
             "    grad_1 = _pick(fused_loss, head_1, 2 * loss_1)",
             ("tests/unit/test_cost_model_techniques.py::test_the_heads_backward_beside_the_logits_gradient_is_within_a_few_percent_of_exact_mode[llama-ref-1-knobs0-0.01]",)),
    Mutation("a pipeline's tied head (GPT-2's embedding copy) makes its gradient beside the logits' gradient",
             "slapo_tune/cost_model/_stage.py",
             "head_after_loss = 2 * loss_1 if layout.tied_head and pipelined else _max(2 * loss_1, head_1 - loss_1)",
             "head_after_loss = _max(2 * loss_1, head_1 - loss_1)",
             ("tests/unit/test_cost_model_techniques.py::test_the_heads_backward_beside_the_logits_gradient_is_within_a_few_percent_of_exact_mode[gpt2-ref-2-knobs2-0.02]",)),
    Mutation("the send bound read off one round of micro-batches, before the steady state",
             "slapo_tune/parallel/_send_release.py", "STEADY_ROUNDS = 2", "STEADY_ROUNDS = 1",
             ("tests/unit/test_send_bound.py::test_the_bound_is_the_proofs_walked_over_the_whole_step",)),
    Mutation("the send bound's walk keeps, for a receive to read, a sender's clock that its later actions move on",
             "slapo_tune/parallel/_send_release.py", "sent_with[r][at] = clock.copy()", "sent_with[r][at] = clock",
             ("tests/unit/test_send_bound.py::test_the_bound_is_the_proofs_walked_over_the_whole_step",)),
    Mutation("the send bound leaves the garbage collector off after torch's lowering",
             "slapo_tune/parallel/_send_release.py", "            gc.enable()", "            pass",
             ("tests/unit/test_send_bound.py::test_the_bound_leaves_the_garbage_collector_as_it_found_it",)),
    Mutation("context-parallel SDPA without dropout gathers the keys and masks them (no chunked flash kernels)",
             "slapo_tune/parallel/_context_parallel.py",
             'kernels = _flash_kernels(query) if size > 1 and kernel == "sdpa" and dropout == 0.0 else None',
             'kernels = None',
             ("tests/multirank/test_context_parallel.py::test_sdpa_keeps_only_the_ranks_keys_and_computes_only_the_causal_pairs",)),
    Mutation("a chunk's queries attend only to their own chunk (the earlier chunks' keys left out)",
             "slapo_tune/parallel/_context_parallel.py", "    if g > 0:\n        spans.append", "    if False:\n        spans.append",
             ("tests/multirank/test_context_parallel.py::test_attention_function_equals_full_causal_attention",)),
    Mutation("the chunked kernels' backward uses each part's own output and log-sum-exp (not the merged ones)",
             "slapo_tune/parallel/_context_parallel.py",
             "                                                   o, lse_rows, st, causal, scale)",
             "                                                   *kernels.forward(q, keys[:, :, start:stop], values[:, :, start:stop], causal, scale)[:2], st, causal, scale)",
             ("tests/multirank/test_context_parallel.py::test_attention_function_equals_full_causal_attention",)),
    Mutation("context parallelism's chunked kernels charged every pair of the masked square",
             "slapo_tune/cost_model/_time.py", "choose(layout.causal & ((cp == 1) | chunked)", "choose(layout.causal & (cp == 1)",
             ("tests/unit/test_time_model.py::test_a_causal_decoders_fused_attention_is_charged_the_causal_masks_kept_pairs",
              "tests/multirank/test_context_parallel.py::test_sdpa_keeps_only_the_ranks_keys_and_computes_only_the_causal_pairs")),
    Mutation("attention dropout does not send context parallelism to the gathered keys",
             "slapo_tune/cost_model/_layout.py", "(attn == \"eager\") | (layout.attention_dropout > 0) |", "(attn == \"eager\") |",
             ("tests/unit/test_time_model.py::test_a_causal_decoders_fused_attention_is_charged_the_causal_masks_kept_pairs",)),
    Mutation("the chunked kernels' memory charged the gathered keys and values",
             "slapo_tune/cost_model/_memory.py", "_pick((cp > 1) & gathers,", "_pick(cp > 1,",
             ("tests/multirank/test_context_parallel.py::test_exact_and_analytic_memory_count_a_chunk_of_the_sequence",
              "tests/unit/test_time_model.py::test_published_runs_fit_and_are_predicted_within_15_percent")),
    Mutation("a layout reads no attention dropout from the config",
             "slapo_tune/cost_model/_layout.py", '    for name in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):',
             '    for name in ():',
             ("tests/unit/test_cost_model_techniques.py::test_a_layouts_attention_dropout_is_what_the_models_attention_trains_with",)),
    Mutation("a runtime accumulating in its GEMMs still pays the accumulation pass", "slapo_tune/cost_model/_time.py",
             "if hw.memory_bandwidth and separate else 0.0", "if hw.memory_bandwidth else 0.0",
             ("tests/unit/test_fsdp_host.py::test_a_runtime_accumulating_in_its_gemms_pays_no_accumulation_pass",
              "tests/unit/test_time_model.py::test_published_runs_fit_and_are_predicted_within_15_percent")),
    Mutation("the CUDA flash backward gets the forward's sequence lengths swapped",
             "slapo_tune/parallel/_context_parallel.py", "cum_q, cum_k, max_q, max_k, 0.0, causal,",
             "cum_q, cum_k, max_k, max_q, 0.0, causal,",
             ("tests/multirank/test_context_parallel.py::"
              "test_the_cuda_flash_calls_match_torchs_schemas_and_give_the_same_attention",)),
    Mutation("a template overriding the old name plan() is sharded by its base's plan", "slapo_tune/template.py",
             '            cls.tensor_parallel_plan = cls.__dict__["plan"]', "            pass",
             ("tests/unit/test_space.py::test_a_template_overriding_the_old_plan_name_is_sharded_by_its_override_with_a_deprecation_warning",)),
    Mutation("super().plan() from an override of the old name comes back to that override", "slapo_tune/template.py",
             "in mro[legacy[-1] + 1 if legacy else 0:]", "in mro",
             ("tests/unit/test_space.py::test_a_template_overriding_the_old_plan_name_is_sharded_by_its_override_with_a_deprecation_warning",)),
    Mutation("start-up: the default made to fit tries every nearest point, past MADE_TO_FIT_TRIES",
             "slapo_tune/search/_driver.py", "                if tried == MADE_TO_FIT_TRIES:", "                if False:",
             (f"{_STARTUP}::test_the_default_made_to_fit_is_the_nearest_fitting_point_of_the_whole_space",)),
    Mutation("start-up: the default made to fit takes the slowest of the nearest points first",
             "slapo_tune/search/_driver.py", "key=lambda i: (-predicted.throughputs[i], i)",
             "key=lambda i: (predicted.throughputs[i], i)",
             (f"{_STARTUP}::test_the_default_made_to_fit_is_the_nearest_fitting_point_of_the_whole_space",)),
    Mutation("start-up: the tuner steps a point exactly though the analytic verdict refuses it",
             "slapo_tune/search/_driver.py", "        if not self.cost.verdict(point, budget).fits:\n            return False\n",
             "",
             (f"{_STARTUP}::test_the_tuners_pruning_asks_the_exact_verdict_only_where_the_analytic_one_lets_the_point_through",)),
    Mutation("start-up: Space.differing counts a knob the reference point does not give", "slapo_tune/space.py",
             "differs = knob.name in point and value != point[knob.name]", "differs = value != point.get(knob.name)",
             ("tests/unit/test_space.py::test_differing_lists_the_points_that_change_so_many_knobs",)),
    Mutation("start-up: Space.first_met forgets what a branch's sub-branches read", "slapo_tune/space.py",
             "                    read |= below_read - {knob.name}\n", "",
             ("tests/unit/test_space.py::test_first_met_is_what_a_walk_of_every_point_meets",)),
    Mutation("start-up: Space.first_met takes values equal but of another type for the same branch",
             "slapo_tune/space.py", "found = known.get(tuple((type(point[n]), point[n]) for n in names))",
             "found = known.get(tuple((type(point[n]), point[n]) for n in names)) or next(\n"
             "                    (v for k, v in known.items() if [x for _, x in k] == [point[n] for n in names]), None)",
             ("tests/unit/test_space.py::test_first_met_is_what_a_walk_of_every_point_meets",)),
    Mutation("start-up: the domains are the first point's values", "slapo_tune/space.py",
             "        for pairs in self.first_met()[0]:", "        for pairs in self.first_met()[0][:1]:",
             ("tests/unit/test_space.py::test_first_met_is_what_a_walk_of_every_point_meets",)),
    Mutation("a published run checkpoints every block or none, whatever share its table gives",
             "benchmarks/published_runs.py", '    ratio = knobs.get("ckpt_ratio", 1.0 if knobs["activation_checkpointing"] else 0.0)',
             '    ratio = 1.0 if knobs["activation_checkpointing"] else 0.0',
             ("tests/unit/test_published_runs.py::test_torchtitans_runs_are_planned_as_its_tables_say",)),
    Mutation("a framework's stated knobs are not applied to its runs", "benchmarks/published_runs.py",
             '    point.update(run["framework"].get("point", {}))', "    pass",
             ("tests/unit/test_published_runs.py::test_torchtitans_runs_are_planned_as_its_tables_say",)),
    Mutation("the published runs' layouts read whatever layout version and torch wrote them",
             "benchmarks/published_runs.py",
             '    fresh = data.get("layout_version") == LAYOUT_VERSION and data.get("torch") == metadata.version("torch")',
             "    fresh = True",
             ("tests/unit/test_published_runs.py::test_a_layout_file_of_another_layout_version_or_torch_is_not_read",)),
    Mutation("rows coded by adding their columns' codes (unequal rows may share one)", "slapo_tune/cost_model/_columns.py",
             "        code = code * values + inverse", "        code = code + inverse",
             ("tests/unit/test_plan_speed.py::test_row_codes_are_equal_exactly_where_the_rows_are",)),
    Mutation("plan's top list orders its layouts by their codes, not by their best point's speed",
             "slapo_tune/cost_model/ranking.py", "        best = best[np.sort(np.unique(keys, return_index=True)[1])]",
             "        best = best[np.unique(keys, return_index=True)[1]]",
             ("tests/unit/test_plan_speed.py::test_plan_json_equals_evaluating_every_point",)),
    Mutation("start-up: the points that may fit come in the verdicts' order, not the space's",
             "slapo_tune/cost_model/ranking.py", '    order = np.argsort(e.index_of[e.fit], kind="stable")  # the space\'s order',
             "    order = np.arange(len(e.fit))",
             (f"{_STARTUP}::test_the_points_that_may_fit_are_found_and_predicted_as_with_the_whole_space",)),
    Mutation("start-up: a point its group's floor prunes is given its layout's floor", "slapo_tune/cost_model/ranking.py",
             "        return int(e.peaks[v]) if v >= 0 else int(e.group_floor[s])",
             "        return int(e.peaks[v]) if v >= 0 else e.layout_floors[tuple(point[k] for k in _LAYOUT_KNOBS)]",
             (f"{_STARTUP}::test_the_points_that_may_fit_are_found_and_predicted_as_with_the_whole_space",)),
    Mutation("start-up: guided's partial table numbers the values as a walk of its own points meets them",
             "slapo_tune/search/_samplers/_guided.py", "        features, width = _features(points, met, names)",
             "        features, width = _features(points, None if not whole else met, names)",
             (f"{_STARTUP}::test_guided_chooses_as_with_the_whole_space_whatever_the_study_knows",)),
    Mutation("start-up: guided's partial table leaves out the points the study knows besides",
             "slapo_tune/search/_samplers/_guided.py", "        for key in known.status:\n            if key not in self._looked:",
             "        for key in ():\n            if key not in self._looked:",
             (f"{_STARTUP}::test_guided_chooses_as_with_the_whole_space_whatever_the_study_knows",)),
    Mutation("start-up: guided's partial table trusts its choice behind an out-of-memory peak",
             "slapo_tune/search/_samplers/_guided.py", '        if not t["whole"] and behind[first]:',
             '        if False:',
             (f"{_STARTUP}::test_guided_chooses_as_with_the_whole_space_whatever_the_study_knows",)),
    Mutation("start-up: guided's partial table, left with no open point, says the space is exhausted",
             "slapo_tune/search/_samplers/_guided.py", '            return None if t["whole"] else self._listed(known)',
             "            return None",
             (f"{_STARTUP}::test_guided_chooses_as_with_the_whole_space_whatever_the_study_knows",
              f"{_STARTUP}::test_guided_and_model_search_as_with_the_whole_space_listed")),
    Mutation("start-up: model's ranking leaves out the points that cannot fit", "slapo_tune/search/_samplers/_ordered.py",
             "        return itertools.chain(self._order, (p for p in self.space.enumerate() if point_key(p) not in self._ranked))",
             "        return iter(self._order)",
             (f"{_STARTUP}::test_guided_and_model_search_as_with_the_whole_space_listed",)),
)

# module -> the default tests that exercise it (the sweep runs them, fastest first, for each mutant)
SWEEP = {
    "slapo_tune/parallel/_data_parallel.py": ["tests/unit/test_build.py::test_the_block_list_is_the_module_list_holding_the_most_parameters",
                                     "tests/unit/test_build.py::test_data_parallel_all_reduces_gradients_in_buckets_of_32_mib",
                                     "tests/unit/test_build.py::test_zero3_makes_every_block_its_own_sharded_unit",
                                     "tests/multirank/test_templates_verify.py::test_data_parallel_averages_every_full_gradient_bucket",
                                     "tests/multirank/test_parallel_3d.py"],
    "slapo_tune/parallel/_comm.py": ["tests/multirank/test_tensor_parallel.py"],
    "slapo_tune/schedule/_sharding.py": ["tests/unit/test_build.py", "tests/unit/test_primitive_errors.py",
                                "tests/multirank/test_tensor_parallel.py"],
    "slapo_tune/runtime.py": ["tests/unit/test_build.py::test_each_data_parallel_rank_takes_its_own_rows_of_the_global_batch",
                              "tests/e2e/test_train.py::test_a_bf16_schedule_trains_under_autocast",
                              "tests/multirank/test_parallel_3d.py"],
    "slapo_tune/cost_model/exact.py": ["tests/multirank/test_cost_model.py::test_exact_mode_counts_the_copy_gloo_makes_in_a_reduce_scatter",
                                       "tests/multirank/test_cost_model.py::test_exact_mode_steady_state_gives_the_peak_of_the_whole_step",
                                       "tests/multirank/test_cost_model.py::test_exact_mode_matches_a_measured_real_step"],
    "slapo_tune/search/_driver.py": ["tests/unit/test_search.py", "tests/e2e/test_faults.py"],
    "slapo_tune/schedule_file.py": ["tests/unit/test_schedule_file.py", "tests/e2e/test_train.py::test_bad_schedule_is_one_line_exit_2",
                                    "tests/e2e/test_train.py::test_malformed_schedule_files_are_refused_by_train_and_valid_ones_run"],
    "slapo_tune/session.py": ["tests/multirank/test_session.py", "tests/multirank/test_runners.py::test_ok_trial_reports_throughput_memory_and_spread",
                              "tests/multirank/test_runners.py::test_budget_below_need_is_oom",
                              "tests/e2e/test_train.py::test_a_bf16_schedule_trains_under_autocast",
                              "tests/e2e/test_train.py::test_killed_job_resumes_to_the_same_weights"],
    "slapo_tune/train.py": ["tests/e2e/test_train.py::test_bad_schedule_is_one_line_exit_2",
                            "tests/e2e/test_train.py::test_tuned_schedule_trains_like_the_unscheduled_model",
                            "tests/e2e/test_train.py::test_killed_job_resumes_to_the_same_weights",
                            "tests/e2e/test_train.py::test_a_bf16_schedule_trains_under_autocast",
                            "tests/e2e/test_train.py::test_initial_weights_come_from_a_hugging_face_checkpoint"],
}


def scratch_copy() -> Path:
    """A copy of the checkout's tracked and untracked (not ignored) files."""
    dest = Path(tempfile.mkdtemp(prefix="slapo-mutant-"))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, target)
    return dest


def _env(copy: Path) -> dict[str, str]:
    # the copy first on the path: this process's tests, spawned ranks and Ray workers import it
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[int, list[str], float, str]:
    """(pytest's exit code, the tests that failed, seconds, the end of pytest's output) in ``copy``;
    stops at the first failure."""
    report = copy / ".mutation-report.xml"
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               f"--junitxml={report}", *tests], cwd=copy, env=_env(copy), capture_output=True,
                              text=True, timeout=timeout, start_new_session=True)
        code = done.returncode
    except subprocess.TimeoutExpired:
        return -1, ["(timed out)"], time.monotonic() - t0, ""
    failed = []
    if report.exists():
        import xml.etree.ElementTree as ET

        for case in ET.parse(report).iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    return code, failed, time.monotonic() - t0, done.stdout[-4000:]


def apply(copy: Path, mutation: Mutation) -> None:
    path = copy / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.name}: the text to replace occurs {text.count(mutation.old)} times in "
                         f"{mutation.path} (expected once); update NAMED")
    path.write_text(text.replace(mutation.old, mutation.new))


def named(only: str | None, timeout: float) -> int:
    """Every named mutation must make at least one of its tests fail; the unmutated copy passes them."""
    mutations = [m for m in NAMED if only is None or only in m.name]
    baseline = scratch_copy()
    try:
        tests = sorted({t for m in mutations for t in m.tests})
        code, failed, seconds, output = run_tests(baseline, tests, timeout)
        if code != 0:
            print(f"{output}\nthe unmutated copy fails its tests ({failed}): fix that first", file=sys.stderr)
            return 1
        print(f"unmutated copy: {len(tests)} test node(s) pass ({seconds:.0f} s)", flush=True)
    finally:
        shutil.rmtree(baseline, ignore_errors=True)
    rows, survivors = [], 0
    for m in mutations:
        copy = scratch_copy()
        try:
            apply(copy, m)
            code, failed, seconds, _ = run_tests(copy, list(m.tests), timeout)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        killed = code != 0
        survivors += not killed
        rows.append({"mutation": m.name, "file": m.path, "killed": killed, "failing": failed, "seconds": seconds})
        print(f"{'killed  ' if killed else 'SURVIVED'} {m.name}: {', '.join(failed) or '-'} ({seconds:.0f} s)",
              flush=True)
    _write("named", rows, ["| mutation | file | failing default test | |", "|---|---|---|---|"] + [
        f"| {r['mutation']} | `{r['file']}` | {'<br>'.join(f'`{t}`' for t in r['failing']) or '-'} | "
        f"{'killed' if r['killed'] else '**survived**'} |" for r in rows])
    return 1 if survivors else 0


# cosmic-ray replaces every binary operator by a dozen others and every number by its neighbours:
# most of those mutants say the same as one canonical swap, or nothing (a limit of 2**31 + 1)
EXCLUDED_OPERATORS = (
    "core/ReplaceBinaryOperator_(?!(Add_Sub|Sub_Add|Mul_Div|Div_Mul|FloorDiv_Mul|Mod_FloorDiv|Pow_Mul)$).*",
    "core/ReplaceComparisonOperator_(?!(Lt_LtE|LtE_Lt|Gt_GtE|GtE_Gt|Eq_NotEq|NotEq_Eq|Is_IsNot|IsNot_Is|In_NotIn"
    "|NotIn_In)$).*",
    "core/ReplaceUnaryOperator_(?!USub_UAdd$).*",
    "core/NumberReplacer", "core/VariableInserter.*", "core/VariableReplacer.*",
)


def _session(module: str, config_text: str) -> Path:
    """The module's cosmic-ray session, kept between runs in ``results/mutation/sessions/``: a run
    goes on with the mutants not yet run and re-runs the survivors (the tests may have improved
    since). A changed module, test selection or operator filter starts a fresh session."""
    import hashlib
    import sqlite3

    key = hashlib.sha256(((ROOT / module).read_text() + config_text).encode()).hexdigest()
    session = OUT / "sessions" / (module.replace("/", "_") + ".sqlite")
    stamp = session.with_suffix(".key")
    if session.exists() and stamp.exists() and stamp.read_text() == key:
        with sqlite3.connect(session) as db:
            db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")
        return session
    session.unlink(missing_ok=True)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(key)
    return session


def sweep(modules: list[str], timeout: float, minutes: float | None) -> int:
    """cosmic-ray over each module in its own scratch copy, with that module's tests; with
    ``minutes``, each module's run stops after that long and reports the mutants it got to
    (cosmic-ray takes pending mutants in random order, so those are a random sample)."""
    tool = Path(sys.executable).parent / "cosmic-ray"
    if not tool.exists():
        raise SystemExit("cosmic-ray is not installed: pip install -e '.[mutation]'")
    summary = {}
    for module in modules:
        copy = scratch_copy()
        tests = " ".join(SWEEP[module])
        config = copy / "cosmic-ray.toml"
        excluded = ", ".join(f"'{op}'" for op in EXCLUDED_OPERATORS)
        config.write_text(
            "[cosmic-ray]\n"
            f'module-path = "{module}"\n'
            f"timeout = {timeout}\n"
            'excluded-modules = []\n'
            f'test-command = "{sys.executable} -m pytest -q -x -p no:cacheprovider {tests}"\n'
            '[cosmic-ray.distributor]\nname = "local"\n'
            f"[cosmic-ray.filters.operators-filter]\nexclude-operators = [{excluded}]\n")
        session = _session(module, f"{tests}|{excluded}")
        env = _env(copy)
        t0 = time.monotonic()
        if not session.exists():
            subprocess.run([str(tool), "init", str(config), str(session)], cwd=copy, env=env, check=True,
                           capture_output=True)
            subprocess.run([str(tool.with_name("cr-filter-operators")), str(session), str(config)], cwd=copy,
                           env=env, check=True, capture_output=True)
        runner = subprocess.Popen([str(tool), "exec", str(config), str(session)], cwd=copy, env=env,
                                  start_new_session=True)
        try:
            runner.wait(timeout=None if minutes is None else minutes * 60)
        except subprocess.TimeoutExpired:  # the time budget is spent: report what ran
            os.killpg(runner.pid, 9)
            runner.wait()  # (a mutant left applied lives in the copy, which goes next)
        dump = subprocess.run([str(tool), "dump", str(session)], cwd=copy, env=env, check=True, capture_output=True,
                              text=True).stdout
        killed, survived, incompetent, skipped, pending, survivors, diffs = 0, 0, 0, 0, 0, [], []
        for line in filter(None, dump.splitlines()):
            item, result = json.loads(line)
            if result is None:
                pending += 1
                continue
            if result.get("worker_outcome") == "skipped":
                skipped += 1
                continue
            if result.get("test_outcome") == "survived":
                survived += 1
                mutation = item["mutations"][0]
                survivors.append(f"{mutation['module_path']}:{mutation['start_pos'][0]} {mutation['operator_name']}"
                                 f" #{mutation['occurrence']}")
                diffs.append(result.get("diff") or "")
            elif result.get("test_outcome") == "incompetent":  # the mutant did not even import or timed out
                incompetent += 1
            else:
                killed += 1
        summary[module] = {"killed": killed, "survived": survived, "incompetent": incompetent, "not_run": pending,
                           "filtered": skipped, "survivors": survivors, "diffs": diffs,
                           "minutes": (time.monotonic() - t0) / 60}
        shutil.rmtree(copy, ignore_errors=True)
        print(f"{module}: {killed} killed, {survived} survived, {incompetent} incompetent, {pending} not run in "
              f"the time budget ({skipped} filtered out; {summary[module]['minutes']:.1f} min this run)", flush=True)
    previous = OUT / "sweep.json"  # runs over some modules replace those modules' rows, keep the others
    summary = {**(json.loads(previous.read_text()) if previous.exists() else {}), **summary}
    _write("sweep", summary, ["| module | killed | survived | incompetent | not run | survivors (line, operator) |",
                              "|---|---|---|---|---|---|"] + [
        f"| `{m}` | {s['killed']} | {s['survived']} | {s.get('incompetent', 0)} | {s['not_run']} | "
        f"{'<br>'.join(s['survivors'][:40])} |"
        for m, s in summary.items()])
    return 0


def _write(kind: str, data, table: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{kind}.json").write_text(json.dumps(data, indent=1))
    (OUT / f"{kind}.md").write_text("\n".join(table) + "\n")
    print(f"wrote {OUT / f'{kind}.md'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    n = sub.add_parser("named", help="each named mutation must fail a default test")
    n.add_argument("--only", default=None, help="the mutations whose name contains this text")
    n.add_argument("--timeout", type=float, default=1200)
    s = sub.add_parser("sweep", help="cosmic-ray over the modules that carry the claims")
    s.add_argument("--modules", nargs="+", default=list(SWEEP), choices=list(SWEEP))
    s.add_argument("--timeout", type=float, default=600, help="seconds per mutant's test run")
    s.add_argument("--minutes", type=float, default=None, help="time budget per module (default: none)")
    args = parser.parse_args(argv)
    if args.command == "named":
        return named(args.only, args.timeout)
    return sweep(args.modules, args.timeout, args.minutes)


if __name__ == "__main__":
    sys.exit(main())
