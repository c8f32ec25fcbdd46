from backends.engine_metrics import PREFIX_HITS, PREFIX_QUERIES, RUNNING, WAITING, parse_samples

TEXT = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 300.0
vllm:prefix_cache_queries_total{model_name="m"} 2000.0
vllm:prefix_cache_queries_created{model_name="m"} 1.7e9
vllm:num_requests_running{model_name="weird } label"} 3.0
vllm:num_requests_waiting 1 1700000000000
vllm:num_requests_swapped{model_name="m"} 9.0
vllm:kv_cache_usage_perc{model_name="m"} NaN
"""


def test_sums_over_label_sets_and_ignores_other_series() -> None:
    got = parse_samples(TEXT, {PREFIX_HITS, PREFIX_QUERIES, RUNNING, WAITING, "vllm:kv_cache_usage_perc"})
    assert got == {PREFIX_HITS: 1500.0, PREFIX_QUERIES: 2000.0, RUNNING: 3.0, WAITING: 1.0}


def test_missing_series_are_absent() -> None:
    assert parse_samples("# nothing here\nother_metric 1\n", {RUNNING}) == {}
