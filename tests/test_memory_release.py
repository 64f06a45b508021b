"""grpokit/train/memory.py: the allocator's free pages go back to the system, and only when there are enough."""

import pytest

from grpokit.train import memory


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


needs_glibc = pytest.mark.skipif(memory._malloc_trim() is None, reason="no malloc_trim / mallinfo2 (not glibc 2.33+)")


@needs_glibc
def test_free_pages_in_the_middle_of_the_heap_go_back_to_the_system():
    """Every other 100 KiB block freed: 300 MiB free inside the heap, which glibc's own top trimming never
    returns; release_free_memory does."""
    blocks = [bytearray(100 << 10) for _ in range(6000)]  # below the mmap threshold: from the heap, touched
    del blocks[::2]
    before = resident_mib()
    assert memory.release_free_memory()
    assert before - resident_mib() > 200
    del blocks


@needs_glibc
def test_nothing_is_trimmed_below_the_threshold():
    assert not memory.release_free_memory(at_least=1 << 60)
