"""KV transfer (workers/kv_transfer): blocks arrive bit-identical through Redis and shared memory, a corrupt
or interrupted transfer is refused with nothing applied, and a sequence prefilled on one runner decodes on
another to the same greedy tokens."""

from __future__ import annotations

import os
import re
import threading
import uuid
from pathlib import Path

import pytest
import redis
import torch

import runner_driver
from model_factory import make_model
from phaseserve.params import SamplingParams
from phaseserve.wire import ScheduledChunk, SeqStart, StepPlan
from phaseserve.workers.kv_cache import KVCache
from phaseserve.workers.kv_transfer import (
    KVLayoutMismatch, KVTransferCorrupt, KVTransferError, KVTransferOutOfOrder, KVTransferTimeout,
)
from phaseserve.workers.kv_transfer.redis_transport import RedisKVReceiver, RedisKVSender, transfer_key
from phaseserve.workers.kv_transfer.shm_transport import ShmKVReceiver, ShmKVSender, transfer_path
from phaseserve.workers.runner import ModelRunner

BUNDLED = Path(__file__).resolve().parents[1] / "phaseserve" / "bundled_model"
TRANSPORTS = ["redis", "shm"]


@pytest.fixture
def client(redis_server):
    c = redis.Redis.from_url(redis_server)
    yield c
    c.close()


def endpoints(transport: str, client, tmp_path: Path, chunk_bytes: int = 4096):
    """(make_sender(transfer_id, cache, block_ids), receiver); small chunks so a test spans many entries."""
    if transport == "redis":
        return (lambda tid, cache, ids: RedisKVSender(client, tid, cache, ids, chunk_bytes=chunk_bytes),
                RedisKVReceiver(client))
    return (lambda tid, cache, ids: ShmKVSender(tid, cache, ids, directory=tmp_path), ShmKVReceiver(directory=tmp_path))


def random_cache(dtype, num_blocks=40, layers=3, kv_heads=2, head_dim=16, block_size=16, seed=0) -> KVCache:
    cache = KVCache(layers, kv_heads, head_dim, block_size=block_size, num_blocks=num_blocks, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bits, so NaN and -0.0 compare exactly."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_blocks_equal(src: KVCache, src_ids, dst: KVCache, dst_ids) -> None:
    s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
    for layer in range(src.num_layers):
        assert torch.equal(raw(src.k[layer][s]), raw(dst.k[layer][d])), f"layer {layer} K differs"
        assert torch.equal(raw(src.v[layer][s]), raw(dst.v[layer][d])), f"layer {layer} V differs"


def snapshot(cache: KVCache) -> list[torch.Tensor]:
    return [t.clone() for t in cache.k + cache.v]


def assert_untouched(cache: KVCache, before: list[torch.Tensor]) -> None:
    assert all(torch.equal(raw(a), raw(b)) for a, b in zip(cache.k + cache.v, before)), "destination was written"


def test_export_import_round_trip_is_bit_identical():
    src = random_cache(torch.bfloat16)
    src.k[1][7, 3, 0, 0] = float("nan")  # any bit pattern survives
    dst = KVCache(3, 2, 16, num_blocks=40, dtype=torch.bfloat16)
    data = src.export_blocks([7, 2, 30])
    assert data.shape == (3, 2, 3, 16, 2, 16) and data.is_contiguous()
    dst.import_blocks([0, 39, 5], data.view(torch.uint8).reshape(-1))
    assert_blocks_equal(src, [7, 2, 30], dst, [0, 39, 5])
    with pytest.raises(ValueError, match="out of range"):
        dst.import_blocks([40, 1, 2], data)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_arrive_bit_identical_streamed_in_pieces(transport, dtype, client, tmp_path):
    """A 37-block prompt with a partial last block (585 tokens), GQA-shaped cache, sent in three pieces as a
    prefill would produce them, into scattered destination ids."""
    src = random_cache(dtype, num_blocks=64, kv_heads=2, head_dim=16)
    dst = KVCache(3, 2, 16, num_blocks=64, dtype=dtype)
    src_ids = list(range(40, 3, -1))  # 37 blocks, reversed: the order of ids matters, not their values
    dst_ids = [(7 * i + 3) % 64 for i in range(37)]
    make_sender, receiver = endpoints(transport, client, tmp_path)
    sender = make_sender("t-" + uuid.uuid4().hex, src, src_ids)
    for a, b in [(0, 8), (8, 30), (30, 37)]:
        sender.send_blocks(a, b)
    sender.finish(36 * 16 + 9)
    summary = receiver.receive(sender.transfer_id, dst, dst_ids, timeout=5)
    assert (summary.num_blocks, summary.num_tokens) == (37, 585)
    assert summary.num_bytes == src.export_nbytes(37)
    assert_blocks_equal(src, src_ids, dst, dst_ids)
    if transport == "redis":
        assert not client.exists(transfer_key("ps", sender.transfer_id)), "the stream outlived the transfer"
    else:
        assert not transfer_path(sender.transfer_id, tmp_path).exists()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_receiver_waits_for_a_sender_in_another_thread(transport, client, tmp_path):
    src, dst = random_cache(torch.bfloat16), KVCache(3, 2, 16, num_blocks=40, dtype=torch.bfloat16)
    make_sender, receiver = endpoints(transport, client, tmp_path)
    tid = "t-" + uuid.uuid4().hex

    def send():
        sender = make_sender(tid, src, [1, 2, 3, 4])
        for i in range(4):  # one block per prefill chunk
            sender.send_blocks(i, i + 1)
        sender.finish(64)

    thread = threading.Timer(0.1, send)
    thread.start()
    receiver.receive(tid, dst, [9, 8, 7, 6], timeout=10)
    thread.join()
    assert_blocks_equal(src, [1, 2, 3, 4], dst, [9, 8, 7, 6])


def test_a_flipped_byte_in_redis_is_detected_and_nothing_applied(client):
    src, dst = random_cache(torch.float32), random_cache(torch.float32, seed=1)
    before = snapshot(dst)
    tid = "t-" + uuid.uuid4().hex
    RedisKVSender(client, tid, src, list(range(10)), chunk_bytes=8192).send_all(10 * 16)
    key = transfer_key("ps", tid)
    entries = client.xrange(key)
    client.delete(key)
    for n, (entry_id, fields) in enumerate(entries):
        if n == 5:  # a chunk in the middle of the transfer
            data = bytearray(fields[b"d"])
            data[1234] ^= 0x10
            fields[b"d"] = bytes(data)
        client.xadd(key, fields, id=entry_id)
    with pytest.raises(KVTransferCorrupt, match="chunk 5"):
        RedisKVReceiver(client).receive(tid, dst, list(range(20, 30)), timeout=2)
    assert_untouched(dst, before)
    assert not client.exists(key)


def test_a_missing_chunk_is_reported_out_of_order(client):
    src, dst = random_cache(torch.float32), random_cache(torch.float32, seed=1)
    before = snapshot(dst)
    tid = "t-" + uuid.uuid4().hex
    RedisKVSender(client, tid, src, list(range(10)), chunk_bytes=8192).send_all(10 * 16)
    key = transfer_key("ps", tid)
    client.xdel(key, client.xrange(key)[3][0])
    with pytest.raises(KVTransferOutOfOrder, match="entry 4 arrived, expected 3"):
        RedisKVReceiver(client).receive(tid, dst, list(range(20, 30)), timeout=2)
    assert_untouched(dst, before)


def test_a_corrupt_shared_memory_segment_is_detected(tmp_path):
    src, dst = random_cache(torch.bfloat16), random_cache(torch.bfloat16, seed=1)
    before = snapshot(dst)
    sender = ShmKVSender("t-corrupt", src, [3, 4, 5], directory=tmp_path)
    sender.send_all(40)
    path = transfer_path("t-corrupt", tmp_path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(KVTransferCorrupt, match="checksum"):
        ShmKVReceiver(directory=tmp_path).receive("t-corrupt", dst, [0, 1, 2], timeout=2)
    assert_untouched(dst, before)
    assert not path.exists()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sender_dying_mid_transfer_times_out_then_a_retry_succeeds(transport, client, tmp_path):
    src, dst = random_cache(torch.bfloat16), random_cache(torch.bfloat16, seed=1)
    before = snapshot(dst)
    make_sender, receiver = endpoints(transport, client, tmp_path)
    dead = make_sender("t-dead", src, list(range(8)))
    dead.send_blocks(0, 5)  # ... and the prefill worker is killed here: no more blocks, no finish
    with pytest.raises(KVTransferTimeout, match="t-dead"):
        receiver.receive("t-dead", dst, list(range(30, 38)), timeout=0.5)
    assert_untouched(dst, before)
    retry = make_sender("t-retry", src, list(range(8)))
    retry.send_all(8 * 16)
    receiver.receive("t-retry", dst, list(range(30, 38)), timeout=5)
    assert_blocks_equal(src, list(range(8)), dst, list(range(30, 38)))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_transfer_nobody_started_times_out(transport, client, tmp_path):
    _, receiver = endpoints(transport, client, tmp_path)
    with pytest.raises(KVTransferTimeout, match="never|nothing"):
        receiver.receive("t-none", KVCache(3, 2, 16, num_blocks=4), [0], timeout=0.2)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mismatched_layout_or_block_count_is_refused(transport, client, tmp_path):
    src = random_cache(torch.bfloat16)
    make_sender, receiver = endpoints(transport, client, tmp_path)
    make_sender("t-dtype", src, [1, 2]).send_all(20)
    with pytest.raises(KVLayoutMismatch, match="layout"):
        receiver.receive("t-dtype", KVCache(3, 2, 16, num_blocks=8, dtype=torch.float32), [0, 1], timeout=2)
    make_sender("t-count", src, [1, 2]).send_all(20)
    with pytest.raises(KVLayoutMismatch, match="2 blocks sent, 3 destination"):
        receiver.receive("t-count", KVCache(3, 2, 16, num_blocks=8, dtype=torch.bfloat16), [0, 1, 2], timeout=2)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_sender_refuses_misuse(transport, client, tmp_path):
    make_sender, _ = endpoints(transport, client, tmp_path)
    sender = make_sender("t-misuse-" + transport, random_cache(torch.float32), [1, 2, 3])
    with pytest.raises(KVTransferOutOfOrder, match="must start at block 0"):
        sender.send_blocks(1, 2)
    sender.send_blocks(0, 2)
    with pytest.raises(KVTransferOutOfOrder, match="2 of 3 blocks"):
        sender.finish(40)
    sender.send_blocks(2, 3)
    with pytest.raises(KVTransferError, match="do not fill the last"):
        sender.finish(20)  # 3 blocks of 16 hold 33..48 tokens
    sender.abort()


# ------------------------------------------------------------------ end to end on two runners

PROMPT_LEN = 45  # three blocks of 16, the last partial
CHUNK = 16
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["bundled-bf16", "gqa-fp32"])
def model_path(request, tmp_path_factory):
    if request.param == "bundled-bf16":
        return BUNDLED
    return make_model(tmp_path_factory.mktemp("kvx"), "llama_gqa_llama3")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_on_one_runner_decode_on_another_matches_one_runner(model_path, transport, client, tmp_path):
    reference = ModelRunner(model_path, num_blocks=32)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, min(300, reference.vocab_size), (PROMPT_LEN,), generator=g).tolist()
    (expected,) = runner_driver.run(reference, [prompt], GREEDY, chunk_size=CHUNK)
    assert len(expected.outputs) == NEW_TOKENS

    prefill, decode = ModelRunner(model_path, num_blocks=32), ModelRunner(model_path, num_blocks=32)
    make_sender, receiver = endpoints(transport, client, tmp_path, chunk_bytes=64 << 10)
    src_blocks = [4, 5, 6]
    sender = make_sender("t-" + uuid.uuid4().hex, prefill.kv, src_blocks)
    starts = [SeqStart("s0", "gw", prompt, GREEDY)]
    first = None
    for step, pos in enumerate(range(0, PROMPT_LEN, CHUNK)):
        n = min(CHUNK, PROMPT_LEN - pos)
        result = prefill.execute(StepPlan(step, "p", starts, [ScheduledChunk("s0", pos, n, src_blocks)]))
        starts = []
        done = (pos + n) // prefill.block_size  # blocks this chunk completed stream out at once
        if done > sender.pieces.sent:
            sender.send_blocks(sender.pieces.sent, done)
        if result.events:
            (event,) = result.events
            first = event.token_ids[0]
    sender.send_blocks(sender.pieces.sent, len(src_blocks))
    sender.finish(PROMPT_LEN)
    assert first == expected.outputs[0]

    dst_blocks = [17, 2, 30]
    receiver.receive(sender.transfer_id, decode.kv, dst_blocks, timeout=5)
    # the decode runner learns the sequence as it learns a recomputed one (SeqStart with its outputs),
    # but its first chunk starts after the prompt: the prompt's KV is already in dst_blocks
    outputs = [first]
    starts = [SeqStart("s0", "gw", prompt, GREEDY, [first], num_cached=PROMPT_LEN)]
    table = list(dst_blocks)
    for step in range(NEW_TOKENS - 1):
        pos = PROMPT_LEN + step
        if pos // decode.block_size >= len(table):
            table.append(20 + len(table))
        result = decode.execute(StepPlan(step, "d", starts, [ScheduledChunk("s0", pos, 1, table)]))
        starts = []
        (event,) = result.events
        assert event.offset == len(outputs)
        outputs += event.token_ids
    assert outputs == expected.outputs


def test_stale_shared_memory_transfers_are_removed(tmp_path):
    import os
    import time

    from phaseserve.workers.kv_transfer.shm_transport import remove_stale_transfers

    cache = random_cache(torch.bfloat16)
    ShmKVSender("t-old", cache, [1], directory=tmp_path).abort()  # abort unlinks what it created
    assert not transfer_path("t-old", tmp_path).exists()
    ShmKVSender("t-orphan", cache, [1], directory=tmp_path).send_all(16)  # nobody ever receives it
    ShmKVSender("t-fresh", cache, [2], directory=tmp_path).send_all(16)
    old = time.time() - 600
    os.utime(transfer_path("t-orphan", tmp_path), (old, old))
    assert remove_stale_transfers(300, tmp_path) == 1
    assert not transfer_path("t-orphan", tmp_path).exists() and transfer_path("t-fresh", tmp_path).exists()


OTHER_UID = 54321  # a local user that is not this one (the tests run as root, so they can chown to it)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_a_transfer_file_planted_by_another_user_is_refused_and_nothing_applied(tmp_path):
    """Another local user creates the file a receiver will look for (the name it expects) with KV of its
    own: the receiver refuses a file it does not own alone, and writes nothing."""
    src, dst = random_cache(torch.bfloat16), random_cache(torch.bfloat16, seed=1)
    before = snapshot(dst)
    for tid, uid, mode in (("t-foreign", OTHER_UID, 0o600), ("t-shared", os.geteuid(), 0o666)):
        ShmKVSender(tid, src, [3, 4, 5], directory=tmp_path).send_all(40)  # a complete, valid transfer...
        path = transfer_path(tid, tmp_path)
        os.chown(path, uid, -1)  # ...whose file is another user's, or writable by anyone
        os.chmod(path, mode)
        with pytest.raises(KVTransferError, match="not private"):
            ShmKVReceiver(directory=tmp_path).receive(tid, dst, [0, 1, 2], timeout=2)
        assert_untouched(dst, before)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_the_transfer_directory_is_the_stacks_own_and_ids_are_unguessable(tmp_path):
    from phaseserve.scheduler.policy import SchedulerConfig, WorkerPolicy
    from phaseserve.workers.kv_transfer.shm_transport import private_dir

    d = private_dir("ps", base=tmp_path)
    assert d.name == f"phaseserve-kv-{os.geteuid()}-ps" and (d.stat().st_mode & 0o777) == 0o700
    assert private_dir("ps", base=tmp_path) == d  # the stack's workers share it
    assert private_dir("{other}", base=tmp_path) != d  # another stack (key prefix) has its own
    # a directory made first by another user, or open to others, is refused, as are senders and receivers in it
    taken = tmp_path / f"phaseserve-kv-{os.geteuid()}-taken"
    taken.mkdir(mode=0o700)
    os.chown(taken, OTHER_UID, -1)
    with pytest.raises(KVTransferError, match="not private"):
        private_dir("taken", base=tmp_path)
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    with pytest.raises(KVTransferError, match="not private"):
        ShmKVReceiver(directory=loose)
    with pytest.raises(KVTransferError, match="not private"):
        ShmKVSender("t-1", random_cache(torch.bfloat16), [1], directory=loose)
    # transfer ids (so file names) are random, not a counter another user could predict
    policy = WorkerPolicy(SchedulerConfig(num_blocks=8, block_size=16, max_model_len=64), "w", transfer_prefix="e1")
    policy.kv_transport = "shm"
    ids = [policy.handoffs.new_send().transfer_id for _ in range(50)]
    assert len(set(ids)) == 50 and all(re.fullmatch(r"e1-[0-9a-f]{24}", i) for i in ids)


KILLED_SENDER = """
import sys, time, redis, torch
from pathlib import Path
from phaseserve.workers.kv_cache import KVCache
from phaseserve.workers.kv_transfer.redis_transport import RedisKVSender
from phaseserve.workers.kv_transfer.shm_transport import ShmKVSender
transport, url, directory, tid = sys.argv[1:5]
cache = KVCache(3, 2, 16, num_blocks=40, dtype=torch.bfloat16)
if transport == "redis":
    sender = RedisKVSender(redis.Redis.from_url(url), tid, cache, list(range(8)), chunk_bytes=4096)
else:
    sender = ShmKVSender(tid, cache, list(range(8)), directory=Path(directory))
sender.send_blocks(0, 5)
print("sent", flush=True)
time.sleep(60)  # killed here, before the rest and before finish
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_killed_sender_process_leaves_nothing_applied(transport, redis_server, client, tmp_path):
    import os
    import subprocess
    import sys

    tid = "t-killed-" + uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SENDER, transport, redis_server, str(tmp_path), tid],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "sent"
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    dst = random_cache(torch.bfloat16, seed=1)
    before = snapshot(dst)
    receiver = endpoints(transport, client, tmp_path)[1]
    with pytest.raises(KVTransferTimeout, match="started but never finished|5 of 8 blocks"):
        receiver.receive(tid, dst, list(range(30, 38)), timeout=0.5)
    assert_untouched(dst, before)
