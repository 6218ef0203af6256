"""Suite-wide fixtures and the list of slow tests.

`SLOW` names the tests that take seconds each (a subprocess, a training run,
a kernel in interpret mode): they get the `slow` marker, so
`python -m pytest -m "not slow"` is the quick edit-test loop and CI
(`bash scripts/test.sh`) still runs everything. An entry is a test file
(`tests/test_x.py`) or a test (`tests/test_x.py::test_name`, every
parametrization of it); `tests/test_suite_config.py` checks that each one
names a test that exists.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")


def _pin_cpu_when_libtpu_has_no_tpu():
    """With libtpu installed (the TPU compile tests) but no TPU or GPU here, JAX
    would probe for a TPU (and take libtpu's lock) in every process: run the
    ordinary suite on the CPU. The compile tests' child process unsets this."""
    import glob
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        return
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or glob.glob("/dev/nvidia[0-9]*"):
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


_pin_cpu_when_libtpu_has_no_tpu()

import numpy as np
import pytest

SLOW = (
    # Subprocesses: fresh interpreters, meshes of simulated devices, other backends.
    "tests/test_distributed_jax.py",
    "tests/test_sharded_metrics.py",
    "tests/erase/test_distributed_torch.py",
    "tests/test_distributed_tf.py",
    "tests/test_distributed_processes.py",
    "tests/test_tpu_compile.py",
    "tests/test_sharded_tpu.py",
    "tests/test_wheel.py",
    "tests/test_examples.py::test_ctr_nproc_global_qps_is_the_slowest_rank_per_step",
    "tests/erase/test_erase_gpu_path.py::test_benchmark_cpu_dry_run_goes_through_graphs",
    "tests/erase/test_erase.py::test_cross_backend_same_weights",
    "tests/test_examples.py::test_backend_flag_selects_backend_before_import",
    "tests/test_memory.py::test_forward_backward_peak_is_under_ten_percent_of_dense_logits",
    "tests/test_readme.py::test_documented_block_runs_as_written",
    "tests/test_readme.py::test_load_model_in_a_fresh_process_after_importing_keras_cutbce",
    # The examples end to end (training runs).
    "tests/test_examples.py::test_run_all_tables_and_printed_paths",
    "tests/test_examples.py::test_sasrec_end_to_end",
    "tests/test_examples.py::test_sasrec_on_movielens_files",
    "tests/test_examples.py::test_sasrec_eval_each_epoch_records_the_curve",
    "tests/test_examples.py::test_sasrec_forward_shape_and_causality",
    "tests/test_examples.py::test_sasrec_with_cut_loss_round_trips_through_keras_file",
    "tests/test_examples.py::test_ctr_compare_table_and_plot",
    "tests/test_examples.py::test_ctr_default_mode_is_erase_auto_and_runs_on_every_backend",
    "tests/test_examples.py::test_towers_shapes",
    "tests/test_examples.py::test_padding_keys_are_masked",
    "tests/test_examples.py::test_baseline_has_no_local_losses_and_same_layers",
    "tests/test_examples.py::test_popularity_metrics_agree_with_top_k_retrieval",
    # fit / save / load round trips.
    "tests/erase/test_erase.py::test_keras_file_round_trip",
    "tests/test_loss.py::test_first_step_matches_dense_bce_and_loss_falls",
    "tests/test_loss.py::test_save_and_load_rebinds_the_table",
    "tests/test_loss.py::test_lora_embedding_table_trains_saves_and_loads",
    "tests/test_metrics.py::test_two_retrieval_metrics_log_under_their_names",
    "tests/test_metrics.py::test_metrics_in_compile_fit_evaluate_save_load",
    "tests/test_training_loops.py::test_stateless_loop_with_a_stateless_scope_trains_the_table",
    "tests/test_training_loops.py::test_stateless_compute_loss_trains_the_table",
    "tests/test_metrics.py::test_get_config_from_config",
    "tests/test_item_embedding.py::test_fit_first_step_matches_dense_bce_for_table_bias_and_model",
    "tests/test_item_embedding.py::test_bias_trains_with_metrics_in_the_step",
    "tests/test_item_embedding.py::test_save_and_load_round_trip",
    "tests/test_item_embedding.py::test_lora_layer_with_a_bias_saves_and_loads",
    "tests/test_item_embedding.py::test_jax_stateless_compute_loss_differentiates_the_bias",
    "tests/test_out_of_range_targets.py::test_logged_by_fit_and_evaluate_and_saved",
    "tests/test_keras_contract.py::test_tf_function_unknown_batch_with_sample_weight",
    "tests/erase/test_erase_torch.py::test_every_dispatch_mode_gives_the_standard_weights_and_logs",
    "tests/erase/test_cuda_graphs.py::test_block_step_has_no_host_data_and_no_host_sync",
    # A 2**24-row table.
    "tests/test_loss.py::test_ids_stay_integers_beyond_float32_precision",
    # Many compiled shapes, or Pallas kernels in interpret mode (JAX).
    "tests/test_cut_bce.py::test_vocab_not_multiple_of_tile",
    "tests/test_cut_bce.py::test_random_shapes_match_keras_bce",
    "tests/test_cut_bce.py::test_low_precision_inputs",
    "tests/test_jax_chunked.py::test_matches_reference_and_keras",
    "tests/test_jax_fused.py::test_matches_reference_and_per_row_kernel",
    "tests/test_saturated_logits.py::test_exact_against_float64",
    "tests/test_loss.py::test_reduced_loss_gradients_match_keras_with_weights_and_mask",
    "tests/test_metrics.py::test_top_k_retrieval_matches_numpy",
    "tests/test_pallas.py::test_fused_weighted_sum_one_logits_pass",
    "tests/test_pallas.py::test_mixed_precision_does_not_promote_to_float32_highest",
    "tests/test_pallas.py::test_randomized",
    "tests/test_pallas.py::test_rows_beyond_one_resident_block",
    "tests/test_pallas.py::test_vocabulary_split_across_two_tensorcores",
    "tests/test_pallas.py::test_bfloat16_inputs",
    "tests/test_pallas.py::test_odd_shapes_bias_smoothing_padding_duplicates",
    "tests/test_pallas.py::test_single_label_pos_weight_large_logits_through_ops",
    "tests/test_saturated_logits.py::test_matches_keras_dense_binary_crossentropy[pallas-0.0]",
    "tests/test_doctests.py::test_docstring_examples[keras_cutbce.backends.jax.pallas]",
    "tests/test_wide_ids.py::test_loss_kernels_treat_wide_ids_as_padding[pallas]",
)


def slow_entry_matches(entry, nodeid):
    """True when the `SLOW` entry names the test `nodeid` (a file, a test, or one of its cases)."""
    return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(slow_entry_matches(entry, item.nodeid) for entry in SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
