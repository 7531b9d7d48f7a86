"""The producer's settings (common/config/producer.py ProducerSettings and the
prompt-source union, common/config/engine.py EngineSettings) and how the engine
maps them onto vLLM (producer/vllm_args.py `resolve_routing`, `engine_args`): bad
values are refused at load time, by `--dry-run` too, naming the dotted key."""
from __future__ import annotations

import pytest

from rlstream.cli import main as cli
from rlstream.common.config import EngineSettings, JsonlPrompts, KafkaTopicPrompts, load_config
from rlstream.common.errors import ConfigError
from rlstream.producer.vllm_args import engine_args, prefix_caching, resolve_routing, resolve_weight_transfer


def load(*overrides: str):
    return load_config(None, list(overrides), environ={})


def refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    return e.value


def test_defaults_are_todays_behaviour():
    p = load().producer
    assert p.prompts == JsonlPrompts(path="runs/data/train.jsonl", seed=0)
    assert p.drain_timeout_s == 60.0
    e = p.engine
    assert (e.max_model_len, e.routing, e.enable_prefix_caching, e.logprobs_mode, e.enable_chunked_prefill) ==\
        (256, "auto", None, "processed_logprobs", True)
    # unset prefix caching: off with capture (today's CPU path), on with native routing (vLLM 0.32 needs it)
    assert prefix_caching(e, "capture") is False and prefix_caching(e, "off") is False
    assert prefix_caching(e, "native") is True
    assert e.kv_cache_memory_bytes == 256 << 20 and e.extra_engine_args == {}
    assert (e.block_size, e.weight_transfer, e.weight_transfer_timeout_s) == (None, "auto", 30.0)


def test_prompt_source_is_a_tagged_union():
    p = load("producer.prompts.type=kafka_topic", "producer.prompts.topic=prompts").producer.prompts
    assert p == KafkaTopicPrompts(topic="prompts", group_id="rlstream-producers")
    # one key of the default (jsonl) source can be set alone
    assert load("producer.prompts.seed=7").producer.prompts == JsonlPrompts(seed=7)
    assert load("producer.prompts={type: jsonl, path: a.jsonl}").producer.prompts.path == "a.jsonl"


@pytest.mark.parametrize("overrides,key,words", [
    # the union's tag is not part of a key a user writes
    (["producer.prompts.type=kafka_topic"], "producer.prompts.topic", "required"),
    (["producer.prompts={type: kafka_topic, topic: t, path: x}"], "producer.prompts.path", "unknown key"),
    (["producer.prompts={type: kafka_topic, topic: ''}"], "producer.prompts.topic", "at least 1"),
    (["producer.prompts.type=http"], "producer.prompts", "jsonl"),
    (["producer.prompts={topic: t}"], "producer.prompts", "needs a type"),
    (["producer.prompts.seed=x"], "producer.prompts.seed", "integer"),
    (["producer.drain_timeout_s=0"], "producer.drain_timeout_s", "greater than 0"),
    (["producer.engine.max_model_len=8"], "producer.engine.max_model_len", "16"),
    (["producer.engine.routing=sometimes"], "producer.engine.routing", "capture"),
    (["producer.engine.logprobs_mode=logits"], "producer.engine.logprobs_mode", "processed_logprobs"),
    (["producer.engine.routing=capture", "producer.engine.tensor_parallel_size=2"],
     "producer.engine.routing", "tensor_parallel_size 1"),
    (["producer.engine.routing=capture", "producer.engine.enforce_eager=false"],
     "producer.engine.routing", "enforce_eager"),
    (["producer.engine.routing=capture", "producer.engine.enable_prefix_caching=true"],
     "producer.engine.routing", "enable_prefix_caching"),
    (["producer.engine.extra_engine_args={dtype: bfloat16}"], "producer.engine.extra_engine_args",
     "set producer.engine.dtype instead"),
    (["producer.engine.extra_engine_args={async_scheduling: true}"], "producer.engine.extra_engine_args",
     "one forward per step"),
    (["producer.engine.extra_engine_args={enable_return_routed_experts: true}"],
     "producer.engine.extra_engine_args", "producer.engine.routing"),
    # sampling the trainer cannot reproduce: refused unless the bias is accepted by name
    (["producer.temperature=0"], "producer.temperature", "greater than or equal to 0.01"),
    # vLLM samples (0, 0.01) at 0.01: the record would claim log-probs it never took
    (["producer.temperature=0.005"], "producer.temperature", "greater than or equal to 0.01"),
    (["producer.temperature=1e300"], "producer.temperature", "less than or equal to 100"),
    (["producer.top_p=0.95"], "producer.top_p", "producer.accept_biased_logprobs"),
    (["producer.engine.logprobs_mode=raw_logprobs", "producer.temperature=0.7"], "producer.engine",
     "producer.accept_biased_logprobs"),
])
def test_bad_values_name_an_existing_key(overrides, key, words):
    e = refused(*overrides)
    assert e.key == key and words in str(e), str(e)


def test_sampling_the_trainer_reproduces_loads_and_the_bias_can_be_accepted_by_name():
    p = load("producer.temperature=0.7").producer  # the record carries it, the trainer applies it
    assert (p.temperature, p.top_p, p.accept_biased_logprobs) == (0.7, 1.0, False)
    assert load("producer.engine.logprobs_mode=raw_logprobs").producer.temperature == 1.0  # raw == processed at 1
    p = load("producer.top_p=0.95", "producer.accept_biased_logprobs=true").producer
    assert p.top_p == 0.95
    p = load("producer.engine.logprobs_mode=raw_logprobs", "producer.temperature=0.7",
             "producer.accept_biased_logprobs=true").producer
    assert p.engine.logprobs_mode == "raw_logprobs"


def test_the_temperature_bounds_are_the_records():
    from rlstream.common.config import ProducerSettings
    from rlstream.common.record import MAX_TEMPERATURE, MIN_TEMPERATURE

    ProducerSettings(temperature=MIN_TEMPERATURE)
    ProducerSettings(temperature=MAX_TEMPERATURE)  # every temperature the config takes, a record takes
    for t in (MIN_TEMPERATURE * 0.99, MAX_TEMPERATURE * 1.01):
        with pytest.raises(Exception):
            ProducerSettings(temperature=t)


def test_dry_run_refuses_biased_sampling_with_exit_code_2(capsys):
    assert cli(["producer", "--dry-run", "--set", "producer.top_p=0.9"]) == 2
    assert "producer.top_p" in capsys.readouterr().err


def test_gpu_settings_can_be_expressed():
    """What the GPU path needs (native routing with prefix caching on, KV cache from
    gpu_memory_utilization, extra vLLM arguments) loads; capture rules do not apply."""
    e = load("producer.engine.routing=native", "producer.engine.enable_prefix_caching=true",
             "producer.engine.tensor_parallel_size=2", "producer.engine.enforce_eager=false",
             "producer.engine.kv_cache_memory_bytes=null",
             "producer.engine.extra_engine_args={attention_backend: FLASHINFER}").producer.engine
    assert (e.routing, e.enable_prefix_caching, e.kv_cache_memory_bytes) == ("native", True, None)


def test_dry_run_refuses_a_bad_producer_key_with_exit_code_2(capsys):
    assert cli(["producer", "--dry-run", "--set", "producer.engine.routing=capture",
                "--set", "producer.engine.tensor_parallel_size=2"]) == 2
    assert "producer.engine.routing" in capsys.readouterr().err
    assert cli(["producer", "--dry-run", "--set", "producer.prompts.type=kafka_topic",
                "--set", "producer.prompts.topic=p"]) == 0
    assert "type: kafka_topic" in capsys.readouterr().out


# ---------------------------------------------------------------- settings -> vLLM

def test_auto_routing_resolves_per_platform_and_checks_what_needs_it():
    assert resolve_routing(EngineSettings(), on_cpu=True) == "capture"
    assert resolve_routing(EngineSettings(), on_cpu=False) == "native"
    assert resolve_routing(EngineSettings(routing="off"), on_cpu=True) == "off"
    for settings, key in [
        (EngineSettings(routing="native"), "producer.engine.routing"),
        (EngineSettings(tensor_parallel_size=2), "producer.engine.routing"),  # auto -> capture on CPU
        (EngineSettings(enable_prefix_caching=True), "producer.engine.routing"),
        (EngineSettings(kv_cache_memory_bytes=None, routing="off"), "producer.engine.kv_cache_memory_bytes"),
    ]:
        with pytest.raises(ConfigError) as e:
            resolve_routing(settings, on_cpu=True)
        assert e.value.key == key
    assert resolve_routing(EngineSettings(tensor_parallel_size=2, kv_cache_memory_bytes=None), on_cpu=False) ==\
        "native"
    # vLLM 0.32 refuses native routing without prefix caching (review B1): refused at start, naming the key
    with pytest.raises(ConfigError) as e:
        resolve_routing(EngineSettings(enable_prefix_caching=False), on_cpu=False)
    assert e.value.key == "producer.engine.enable_prefix_caching"


def test_weight_transfer_resolves_per_platform():
    assert resolve_weight_transfer(EngineSettings(), on_cpu=True) == "rlstream_gloo"
    assert resolve_weight_transfer(EngineSettings(tensor_parallel_size=2), on_cpu=False) == "nccl"
    assert resolve_weight_transfer(EngineSettings(weight_transfer="off"), on_cpu=True) is None
    # every worker of a TP engine joins the link's group (common/weights/link.py group_layout)
    assert resolve_weight_transfer(EngineSettings(tensor_parallel_size=2), on_cpu=True) == "rlstream_gloo"
    with pytest.raises(ConfigError) as e:
        resolve_weight_transfer(EngineSettings(weight_transfer="nccl"), on_cpu=True)
    assert e.value.key == "producer.engine.weight_transfer"
    args = engine_args(EngineSettings(block_size=16, enable_prefix_caching=True, routing="off"), "/m", "off",
                       on_cpu=True, weight_transfer="rlstream_gloo")
    assert args["weight_transfer_config"] == {"backend": "rlstream_gloo"} and args["block_size"] == 16
    assert args["enable_prefix_caching"] is True
    assert args["worker_extension_cls"] == "rlstream.producer.weights.worker.gloo_engine.RlstreamWorkerExtension"
    assert "weight_transfer_config" not in engine_args(EngineSettings(), "/m", "capture", on_cpu=True)


def test_engine_args_follow_the_settings():
    cpu = engine_args(EngineSettings(), "/m", "capture", on_cpu=True)
    assert cpu["model"] == "/m" and cpu["max_model_len"] == 256 and cpu["kv_cache_memory_bytes"] == 256 << 20
    assert cpu["enable_prefix_caching"] is False and cpu["async_scheduling"] is False
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["enable_chunked_prefill"] is True
    assert not {"gpu_memory_utilization", "quantization", "enable_return_routed_experts",
                "max_num_batched_tokens"} & set(cpu)
    gpu = engine_args(EngineSettings(routing="native", enable_prefix_caching=True, quantization="fp8",
                                     max_num_batched_tokens=4096, extra_engine_args={"attention_backend": "X"}),
                      "/m", "native", on_cpu=False)
    assert gpu["enable_return_routed_experts"] is True and gpu["enable_prefix_caching"] is True
    assert gpu["quantization"] == "fp8" and gpu["gpu_memory_utilization"] == 0.85
    assert gpu["max_num_batched_tokens"] == 4096 and gpu["attention_backend"] == "X"
