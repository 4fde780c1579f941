#!/usr/bin/env python3
"""Unit tests of the block keys of kvdepot.integrations (shared by the engine
connectors and tools/multiturn): the encoding, fixed test vectors, chaining,
and the same keys in another process; and of its CircuitBreaker. Needs only the package on PYTHONPATH
(exits 77 without it).

    PYTHONPATH=build/python /usr/bin/python3 client/python/tests/test_block_keys.py -v
"""

import hashlib
import os
import subprocess
import sys
import unittest

try:
    from kvdepot.integrations import (
        ROOT_HASH,
        CircuitBreaker,
        block_hashes,
        encode_block,
        hash_block,
        model_label,
        parents_of,
    )
except ImportError as e:  # pragma: no cover
    print(f"test_block_keys: kvdepot package not importable ({e}); skipping")
    sys.exit(77)

# Written down once; a change here changes every stored key.
ROOT_HEX = "6cb396dac78b65cec3f950504609a732d4133351a077546466c07133484fe5d0"
BLOCK_0_15_HEX = "223ad76c3c53159c217e3d2b9f74b10e6d1c13c12ac1786304bd4cedaee27500"
BLOCK_0_15_EXTRA_HEX = (
    "134fc2cba9b6eb109c612011094d2d9c502c039db01291cef27575f60685197a"
)


class EncodingTest(unittest.TestCase):
    def test_encoding_is_the_documented_byte_layout(self):
        self.assertEqual(
            encode_block(b"", [1, 2], ("x",)),
            b"KVB1"
            + bytes.fromhex("00000000")  # parent: length 0
            + bytes.fromhex("02000000" "01000000" "02000000")  # 2 tokens: 1, 2
            + bytes.fromhex("01000000")  # 1 extra key
            + b"s" + bytes.fromhex("01000000") + b"x",  # str "x"
        )
        self.assertEqual(
            encode_block(b"", [], (b"\x00", -1)),
            b"KVB1" + bytes(4) + bytes(4) + bytes.fromhex("02000000")
            + b"b" + bytes.fromhex("01000000") + b"\x00"
            + b"i" + bytes.fromhex("08000000") + b"\xff" * 8,
        )

    def test_fixed_vectors(self):
        self.assertEqual(ROOT_HASH.hex(), ROOT_HEX)
        self.assertEqual(
            ROOT_HASH, hashlib.sha256(b"kvdepot/block-hash/v1/root").digest())
        self.assertEqual(hash_block(ROOT_HASH, range(16)).hex(), BLOCK_0_15_HEX)
        self.assertEqual(
            hash_block(ROOT_HASH, range(16), ("lora-a", b"salt", 7)).hex(),
            BLOCK_0_15_EXTRA_HEX)

    def test_extra_keys_are_typed(self):
        tokens = list(range(16))
        keys = {hash_block(ROOT_HASH, tokens, extra)
                for extra in [(), ("1",), (b"1",), (1,), ("1", "1")]}
        self.assertEqual(len(keys), 5)
        with self.assertRaises(TypeError):
            hash_block(ROOT_HASH, tokens, (True,))
        with self.assertRaises(TypeError):
            hash_block(ROOT_HASH, tokens, (1.5,))


class ChainTest(unittest.TestCase):
    TOKENS = [(i * 7919) % 50000 for i in range(16 * 5 + 9)]

    def test_chain_links_each_block_to_its_parent(self):
        keys = block_hashes(self.TOKENS, 16)
        self.assertEqual(len(keys), 5)  # the partial last block has no key
        parent = ROOT_HASH
        for b, key in enumerate(keys):
            self.assertEqual(key, hash_block(parent, self.TOKENS[16 * b:16 * b + 16]))
            parent = key

    def test_a_key_names_the_whole_prefix(self):
        changed = list(self.TOKENS)
        changed[20] += 1  # in block 1
        a, b = block_hashes(self.TOKENS, 16), block_hashes(changed, 16)
        self.assertEqual(a[0], b[0])
        self.assertTrue(all(x != y for x, y in zip(a[1:], b[1:])))

    def test_extending_a_chain_equals_hashing_it_whole(self):
        whole = block_hashes(self.TOKENS, 16, ("salt",))
        head = block_hashes(self.TOKENS[:32], 16, ("salt",))
        tail = block_hashes(self.TOKENS, 16, ("salt",), start_block=2, parent=head[-1])
        self.assertEqual(head + tail, whole)
        with self.assertRaises(ValueError):
            block_hashes(self.TOKENS, 16, start_block=2)

    def test_parents_of(self):
        self.assertEqual(parents_of([b"a", b"b", b"c"]), [b"", b"a", b"b"])
        self.assertEqual(parents_of([b"c"], b"b"), [b"b"])
        self.assertEqual(parents_of([]), [])

    def test_same_keys_in_another_process(self):
        code = (
            "from kvdepot.integrations import block_hashes;"
            "print(b''.join(block_hashes(list(range(100)), 16, ('s', 3))).hex())"
        )
        mine = b"".join(block_hashes(list(range(100)), 16, ("s", 3))).hex()
        for seed in ("0", "12345"):
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True,
                check=True, env={**os.environ, "PYTHONHASHSEED": seed})
            self.assertEqual(out.stdout.strip(), mine)


class ModelLabelTest(unittest.TestCase):
    def test_clean_names_are_kept(self):
        # Namespaces of names a namespace can hold as they are do not move.
        self.assertEqual(model_label("vllm", "meta-llama/Llama-3-8B", "tp0of1"),
                         "vllm/meta-llama/Llama-3-8B/tp0of1")

    def test_names_that_read_alike_once_cleaned_stay_apart(self):
        labels = {
            model_label("vllm", name, "tp0of1")
            for name in ("llama 3", "llama#3", "llama-3", "/models/x", "models/x",
                         "models/x/", "", "-")
        }
        self.assertEqual(len(labels), 8, labels)

    def test_long_names_are_cut_and_stay_apart(self):
        a = model_label("m" * 200 + "a")
        b = model_label("m" * 200 + "b")
        self.assertLessEqual(max(len(a), len(b)), 100)
        self.assertNotEqual(a, b)



class CircuitBreakerTest(unittest.TestCase):
    def setUp(self):
        self.now = 100.0
        self.breaker = CircuitBreaker("test", min_s=1.0, max_s=4.0, clock=lambda: self.now)
        self.assertTrue(self.breaker.failed(RuntimeError("UNAVAILABLE: gone")))

    def test_a_probe_the_daemon_answers_with_another_error_closes_it(self):
        # Any answer means the daemon is back: a probe that gets, say,
        # RESOURCE_EXHAUSTED must not leave the breaker open for good.
        self.assertFalse(self.breaker.allow())
        self.now += 1.01
        self.assertTrue(self.breaker.allow())  # the probe
        with self.assertLogs("kvdepot.integrations", "WARNING"):
            self.assertFalse(self.breaker.failed(RuntimeError("RESOURCE_EXHAUSTED: full")))
        self.assertFalse(self.breaker.is_open)
        self.assertTrue(self.breaker.allow())
        # A per-block error is an answer too.
        self.assertTrue(self.breaker.failed(("DEADLINE_EXCEEDED", "late")))
        self.assertFalse(self.breaker.failed(("NOT_FOUND", "miss")))
        self.assertFalse(self.breaker.is_open)

    def test_a_local_error_changes_nothing(self):
        self.now += 1.01
        self.assertTrue(self.breaker.allow())
        self.assertFalse(self.breaker.failed(ValueError("bad argument")))
        self.assertTrue(self.breaker.is_open)
        # Nor do codes that the module raises before any call as well.
        for local in ("INVALID_ARGUMENT: buffer 0 has 10 bytes", "OUT_OF_RANGE: block 9"):
            self.assertFalse(self.breaker.failed(ValueError(local)))
            self.assertTrue(self.breaker.is_open, local)
        self.assertFalse(self.breaker.allow())  # the next window's probe waits

    def test_failed_probes_double_the_window_up_to_the_limit(self):
        # Opened at 100 for 1 s; each failed probe doubles it: 2, 4, then 4.
        probe_at = 101.0
        for window in (2.0, 4.0, 4.0):
            self.now = probe_at - 0.01
            self.assertFalse(self.breaker.allow(), window)
            self.now = probe_at + 0.01
            self.assertTrue(self.breaker.allow(), window)
            self.assertTrue(self.breaker.failed(RuntimeError("UNAVAILABLE: still gone")))
            probe_at = self.now + window
        self.now = probe_at - 0.01
        self.assertFalse(self.breaker.allow())
        self.now = probe_at + 0.01
        self.assertTrue(self.breaker.allow())


if __name__ == "__main__":
    unittest.main()
