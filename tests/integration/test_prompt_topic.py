"""Prompts from a Kafka topic (real broker): served in order, bad ones dead-lettered."""
import json

import pytest

pytestmark = [pytest.mark.broker]


@pytest.mark.timeout(120)
def test_kafka_prompt_source_serves_prompts_and_dead_letters_bad_ones(kafka_settings):
    import time

    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    from rlstream.common.config import KafkaTopicPrompts
    from rlstream.common.kafka.client import client_kwargs
    from rlstream.producer.prompts import KafkaPromptSource, open_prompt_source

    topic = kafka_settings.topics.rollouts.replace("rollouts", "prompts")
    p = KafkaProducer(**client_kwargs(kafka_settings), acks="all")
    msgs = [{"prompt": "1+2=", "answer": 3}, b"{not json", {"prompt": "4+4=", "answer": "8", "id": "q2"},
            {"answer": "5"}, {"prompt": "9-3=", "answer": 6}]
    for m in msgs:
        p.send(topic, key=b"k", value=m if isinstance(m, bytes) else json.dumps(m).encode()).get(timeout=10)
    p.close()
    src = open_prompt_source(KafkaTopicPrompts(topic=topic, group_id=f"g-{topic}"), kafka_settings)
    assert isinstance(src, KafkaPromptSource)
    got, deadline = [], time.time() + 60
    while len(got) < 3 and time.time() < deadline:
        pr = src.take(timeout_s=0.5)
        if pr is not None:
            got.append(pr)
    src.close()
    assert [(g.task.prompt, g.task.reference) for g in got] == [("1+2=", "3"), ("4+4=", "8"), ("9-3=", "6")]
    assert got[1].prompt_id == "q2"
    c = KafkaConsumer(**client_kwargs(kafka_settings), group_id=None, auto_offset_reset="earliest")
    c.assign([TopicPartition(kafka_settings.topics.dlq, 0)])
    dead, deadline = [], time.time() + 30
    while len(dead) < 2 and time.time() < deadline:
        dead += [m for batch in c.poll(timeout_ms=250).values() for m in batch]
    c.close()
    assert [m.value for m in dead] == [b"{not json", json.dumps(msgs[3]).encode()]
    reasons = [dict(m.headers)["rlstream-reason"].decode() for m in dead]
    assert "Expecting property name" in reasons[0]
    assert "'prompt' must be a non-empty string" in reasons[1]
