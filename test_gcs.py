"""gs:// paths against a Google Cloud Storage server on 127.0.0.1 (conftest.py's `gcs_server`,
gcs_emulator.py): preparing data into and from a bucket, training with the data and the run directory
in one, exporting and importing there, and a bucket that does not exist.
"""
import fsspec
import pytest


def store():
    """A view of the server that caches no listing: it sees what other processes wrote."""
    return fsspec.filesystem("gs", skip_instance_cache=True, use_listings_cache=False)


def test_the_server_keeps_generations_and_their_preconditions(gcs_bucket):
    """What tensorstore (orbax's arrays) relies on: every read says the generation it read, and a write or
    read conditioned on a generation is refused when the object is not (or is) that generation."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "gcs", "bucket": gcs_bucket.removeprefix("gs://")}).result()
    first = kv.write("a", b"one").result().generation
    read = kv.read("a").result()
    assert (read.state, read.value, read.stamp.generation) == ("value", b"one", first)
    second = kv.write("a", b"two", if_equal=first).result().generation  # the generation it was: done
    assert second not in (first, b"")
    refused = kv.write("a", b"three", if_equal=first).result()  # no longer that generation: 412, nothing written
    assert refused.generation == b"" and kv.read("a").result().value == b"two"
    unchanged = kv.read("a", if_not_equal=second).result()  # 304: the reader's copy is current
    assert unchanged.state == "unspecified" and unchanged.value == b""
    assert store().cat_file(f"{gcs_bucket}/a") == b"two"  # gcsfs sees the same object
