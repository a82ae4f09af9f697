"""A stack on a Redis Cluster: three primaries (redis-server --cluster-enabled yes, joined by CLUSTER MEET),
the stack given the redis+cluster:// URL. Every key of the stack lands in one hash slot (the key prefix
becomes a hash tag), on the node owning it; a chat completion is served end to end (docs/redis.md,
"Redis Cluster")."""

from __future__ import annotations

import openai

from e2e_stack import running_stack
from phaseserve.redis_topologies import ClusterSet
from phaseserve.redis_url import key_prefix_for


def test_a_stack_serves_a_chat_completion_on_a_three_primary_cluster(e2e_model, tmp_path):
    with ClusterSet(primaries=3) as cluster, running_stack(e2e_model, tmp_path, redis_url=cluster.url) as stack:
        prefix = key_prefix_for(cluster.url, stack.key_prefix)
        assert prefix == "{ps}"
        with openai.OpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=120) as client:
            reply = client.chat.completions.create(model=stack.model, max_tokens=8, temperature=0,
                                                   messages=[{"role": "user", "content": "Say hello"}])
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=stack.model, max_tokens=8, temperature=0, stream=True,
                messages=[{"role": "user", "content": "Say hello"}]) if c.choices)
        assert reply.choices[0].message.content
        assert streamed == reply.choices[0].message.content  # greedy: the same text both ways

        clients = [cluster.client(n) for n in cluster.nodes]
        try:
            keys_by_node = [c.keys("*") for c in clients]
            holders = [i for i, keys in enumerate(keys_by_node) if keys]
            assert len(holders) == 1, f"the stack's keys are spread over nodes {holders}"
            keys = keys_by_node[holders[0]]
            assert all(k.startswith(prefix.encode() + b":") for k in keys), keys
            slots = {clients[0].execute_command("CLUSTER", "KEYSLOT", k) for k in keys}
            assert slots == {clients[0].execute_command("CLUSTER", "KEYSLOT", prefix)}
            assert any(k.endswith(b":requests") for k in keys) and any(b":steps:" in k for k in keys)
        finally:
            for c in clients:
                c.close()
