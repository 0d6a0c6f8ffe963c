"""The block digests of formats 2 (sha256) and 3 (BLAKE3): every way of computing one (while writing,
per range on many threads, from a file, from bytes) gives the same value, and a damaged or missing
block is never taken for whole."""
from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path

import blake3
import pytest

from uploader.hashing import (
    ALGORITHM,
    ALGORITHMS,
    BLAKE3,
    BlockDigest,
    HashingWriter,
    StreamDigest,
    align_up,
    digest_bytes,
    file_digest,
    new_hash,
)

B = 4096  # a small block keeps the sizes small; the code has no special case for 1 MiB
SIZES = [0, 1, B - 1, B, B + 1, 3 * B + 5]


def reference(data: bytes, block_size: int, algorithm: str) -> str:
    """The definition, spelled out with the libraries themselves: the hash of the concatenated hashes of
    the blocks (sha256 for format 2, BLAKE3 for format 3)."""
    hash_of = {"sha256": lambda b: hashlib.sha256(b).digest(), "blake3": lambda b: blake3.blake3(b).digest()}[algorithm]
    blocks = [hash_of(data[i : i + block_size]) for i in range(0, len(data), block_size)]
    return hash_of(b"".join(blocks)).hex()


def random_pieces(data: bytes, rng: random.Random) -> list[bytes]:
    pieces, at = [], 0
    while at < len(data):
        n = rng.choice([1, 7, B - 1, B, B + 3, 2 * B])
        pieces.append(data[at : at + n])
        at += n
    return pieces


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("size", SIZES)
def test_every_way_of_computing_it_agrees(tmp_path: Path, size: int, algorithm: str) -> None:
    rng = random.Random(size)
    data = rng.randbytes(size)
    expected = reference(data, B, algorithm)

    stream = StreamDigest(B, algorithm)
    for piece in random_pieces(data, rng):
        stream.update(memoryview(piece))

    sink = io.BytesIO()
    writer = HashingWriter(sink, block_size=B, algorithm=algorithm)
    for piece in random_pieces(data, rng):
        writer.write(piece)

    path = tmp_path / "f"
    path.write_bytes(data)

    assert digest_bytes(data, B, algorithm) == stream.hexdigest() == writer.hexdigest() == expected
    assert file_digest(path, B, threads=3, algorithm=algorithm) == (size, expected)
    assert sink.getvalue() == data and writer.size == size


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("size", SIZES)
def test_ranges_hashed_in_any_order_and_retried_give_the_same_digest(size: int, algorithm: str) -> None:
    rng = random.Random(size)
    data = rng.randbytes(size)
    blocks = BlockDigest(size, B, algorithm)
    span = align_up(B + 1, B)  # two blocks per range, as a 5.5 MiB part over 1 MiB blocks is aligned
    starts = list(range(0, size, span))
    rng.shuffle(starts)
    for start in starts:
        part = data[start : start + span]
        blocks.at(start).update(part[: len(part) // 2])  # an attempt that died half-way...
        retry = blocks.at(start)  # ...and its retry, hashing the range afresh
        for piece in random_pieces(part, rng):
            retry.update(piece)
    assert blocks.hexdigest() == reference(data, B, algorithm)


def test_a_flipped_byte_changes_the_digest() -> None:
    data = bytearray(random.Random(0).randbytes(3 * B + 5))
    before = digest_bytes(data, B)
    data[2 * B + 1] ^= 0x01
    assert digest_bytes(data, B) != before


def test_a_range_never_received_is_not_taken_for_a_whole_file() -> None:
    blocks = BlockDigest(3 * B, B)
    blocks.at(0).update(b"x" * B)
    blocks.at(2 * B).update(b"x" * B)
    with pytest.raises(ValueError, match="1 block"):
        blocks.hexdigest()


def test_a_range_must_start_on_a_block_and_stay_inside_the_file() -> None:
    blocks = BlockDigest(2 * B, B)
    with pytest.raises(ValueError, match="block boundary"):
        blocks.at(B // 2)
    with pytest.raises(ValueError, match="more bytes"):
        blocks.at(B).update(b"x" * (B + 1))


def test_format_1_is_a_plain_sha256(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(3 * B + 5)
    path = tmp_path / "f"
    path.write_bytes(data)
    plain = hashlib.sha256(data).hexdigest()
    writer = HashingWriter(io.BytesIO(), block_size=None)
    writer.write(data)
    assert digest_bytes(data, None) == writer.hexdigest() == file_digest(path, None)[1] == plain
    assert align_up(5, None) == 5


def test_new_checkpoints_use_blake3_and_the_two_block_digests_differ() -> None:
    data = random.Random(2).randbytes(3 * B + 5)
    assert ALGORITHM == BLAKE3 and digest_bytes(data, B) == reference(data, B, "blake3")
    assert digest_bytes(data, B, "sha256") != digest_bytes(data, B, "blake3")
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        new_hash("md5")
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        BlockDigest(10, B, "crc32")
