"""The engine's file tier on the CPU: blocks whose weights are views of their checkpoint file are read from
it each step (no host buffer), or packed from it within a host cap, and give the resident model's output.

The weights are a real safetensors file mapped read-only (``harness/mapped_file.py``), as ComfyUI's
Dynamic VRAM loader maps them; nodes-level tests run ComfyUI's own reader (test_dynamic_vram.py).
"""

from __future__ import annotations

import copy
import errno
import itertools
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.fake_cudart import FakeCudart
from harness.mapped_file import MappedFile
from harness.parking import lot_of
from harness.transformer_stack import forward_steps, transformer_stack

from block_offload.offload import (
    BlockStreamer,
    CallOptions,
    CudaHostRegistrar,
    FileChangedError,
    FileOptions,
    HostOptions,
    RingOptions,
    SequentialOptions,
    StreamSpec,
    TimelineRecorder,
    file_source,
    stream_blocks,
    stream_modules,
    use_host_registrar,
)
from block_offload.offload.layout import DtypeOf

CPU = torch.device("cpu")


def _mapped_stack(tmp_path: Path, stored: torch.dtype = torch.float32, blocks: int = 6, dim: int = 32):
    """A stack and its twin whose weights are views of the stack saved in ``stored``."""
    model = transformer_stack(num_blocks=blocks, dim=dim)
    twin = copy.deepcopy(model)
    return model, MappedFile(twin, tmp_path / "stack.safetensors", stored)


def _streamer(
    mapped: MappedFile,
    read_each_step,
    device: torch.device = CPU,
    host: HostOptions | None = None,
    ring: RingOptions | None = None,
    dtype_of: DtypeOf | None = None,
    recorder: TimelineRecorder | None = None,
) -> BlockStreamer:
    blocks = list(mapped.module.blocks)
    return stream_blocks(
        blocks,
        device,
        range(len(blocks)),
        StreamSpec(
            host=replace(host or HostOptions(), parking=lot_of(mapped.module)),
            ring=ring or RingOptions(),
            files=FileOptions(file_slice=mapped.file_slice, dtype_of=dtype_of, read_each_step=read_each_step),
            calls=CallOptions(root=mapped.module),
            recorder=recorder,
        ),
    )


@pytest.mark.parametrize("read_each_step", [range(6), range(0, 6, 2), ()], ids=["all", "every-other", "none"])
def test_blocks_read_from_the_file_each_step_give_the_resident_output(tmp_path: Path, read_each_step) -> None:
    model, mapped = _mapped_stack(tmp_path)
    x = torch.randn(2, 7, 32)
    reference = forward_steps(model, x, steps=3)
    views = {name: tensor.data_ptr() for name, tensor in mapped.module.state_dict().items()}
    streamer = _streamer(mapped, read_each_step, ring=RingOptions(prefetch=2))
    streamer.enable()
    per_block = streamer.report().file_tier_bytes
    assert per_block == sum(
        mapped.file_slice(tensor).nbytes
        for index in read_each_step
        for tensor in mapped.module.blocks[index].state_dict().values()
    )
    outputs = forward_steps(mapped.module, x, steps=3)
    for out, expected in zip(outputs, reference, strict=True):
        assert torch.equal(out, expected)
    # Every file-tier block read once per step and nothing else, but for the reads already made for the
    # next step: as far ahead as the copies (prefetch 2) and the staging slots (2) run.
    streamer.release_device_buffers()
    largest = max((streamer.host.blocks[i].read.file_bytes for i in read_each_step), default=0)
    bytes_read = streamer.report().bytes_read
    assert 3 * per_block <= bytes_read <= 3 * per_block + (2 + 2) * largest, (bytes_read, per_block)
    host_buffers = sum(
        sum(t.numel() * t.element_size() for t in mapped.module.blocks[i].state_dict().values())
        for i in set(range(6)) - set(read_each_step)
    )
    slots = 2 * max((streamer.host.blocks[i].read.nbytes for i in read_each_step), default=0)
    assert streamer.report().host_bytes <= host_buffers + slots + 6 * 256 * 8  # alignment padding per tensor
    streamer.disable()
    # The module holds its file's views again: nothing was copied into memory of its own.
    assert {name: tensor.data_ptr() for name, tensor in mapped.module.state_dict().items()} == views
    assert all(mapped.mapped(tensor) for tensor in mapped.module.state_dict().values())


def test_staging_slots_are_faulted_in_before_the_driver_registers_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging slots are pinned as host buffers are: their fresh pages first touched on torch's threads (zeroed),
    so the driver's registration, on one thread, finds them in memory (CUDA's runtime faked, the engine's real
    registrar). Blocks of 50 MB: over glibc's largest mmap threshold (32 MiB), every slot is fresh memory."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    model, mapped = _mapped_stack(tmp_path, blocks=2, dim=1024)
    x = torch.randn(1, 4, 1024)
    use_host_registrar(CudaHostRegistrar())
    try:
        streamer = _streamer(mapped, range(2), host=HostOptions(pin_memory=True))
        streamer.enable()
        assert streamer.report().staging_bytes > 2 * 32 * 2**20 and fake.pinned == streamer.report().staging_bytes
        assert list(fake.resident_at_registration.values()) == [1.0, 1.0]
        assert torch.equal(forward_steps(mapped.module, x, steps=1)[0], forward_steps(model, x, steps=1)[0])
        streamer.disable()
        assert fake.registered == {}
    finally:
        use_host_registrar(None)


def test_a_file_stored_in_fp32_is_read_as_stored_and_cast_on_the_device(tmp_path: Path) -> None:
    """``dtype_of`` gives the compute dtype: the file tier reads fp32 and casts after the copy, the host
    tier packs bf16; both give the model cast to bf16, resident."""
    model, mapped = _mapped_stack(tmp_path)
    reference_model = copy.deepcopy(model).to(torch.bfloat16)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16)
    reference = forward_steps(reference_model, x, steps=2)
    streamer = _streamer(
        mapped, range(1, 6, 2), ring=RingOptions(prefetch=1), dtype_of=lambda module, name: torch.bfloat16
    )
    streamer.enable()
    assert streamer.report().file_tier_bytes == sum(
        t.numel() * 4 for i in range(1, 6, 2) for t in mapped.module.blocks[i].state_dict().values()
    )
    # The blocks outside the stream are the host's to cast (ComfyUI casts what it loads).
    for name, child in mapped.module.named_children():
        if name != "blocks":
            child.to(torch.bfloat16)
    outputs = forward_steps(mapped.module, x, steps=2)
    for out, expected in zip(outputs, reference, strict=True):
        assert torch.equal(out, expected)
    streamer.disable()
    assert all(t.dtype == torch.float32 for t in mapped.module.blocks.state_dict().values())


def test_without_a_positional_read_the_mapping_is_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows has no os.preadv: the reader copies the bytes from the file's mapping instead."""
    monkeypatch.setattr(file_source, "POSITIONAL_READ", None)
    model, mapped = _mapped_stack(tmp_path)
    x = torch.randn(2, 7, 32)
    reference = forward_steps(model, x, steps=2)
    streamer = _streamer(mapped, range(6))
    streamer.enable()
    for out, expected in zip(forward_steps(mapped.module, x, steps=2), reference, strict=True):
        assert torch.equal(out, expected)
    streamer.disable()


def test_a_truncated_file_stops_the_run_with_a_clear_error_and_the_model_is_restored(tmp_path: Path) -> None:
    model, mapped = _mapped_stack(tmp_path)
    x = torch.randn(2, 7, 32)
    streamer = _streamer(mapped, range(6))
    streamer.enable()
    forward_steps(mapped.module, x, steps=1)
    streamer.release_device_buffers()
    size = os.path.getsize(mapped.path)
    with open(mapped.path, "r+b") as file:
        file.truncate(size // 2)
    with pytest.raises(FileChangedError, match=r"stack.safetensors changed while .*load the model again"):
        forward_steps(mapped.module, x, steps=1)
    streamer.close_open_step()
    streamer.disable()
    assert not streamer.enabled


@pytest.mark.parametrize("ring_bytes", [None, 1 << 26], ids=["ring-of-two", "ring-holding-every-block"])
def test_a_read_that_fails_once_leaves_no_stale_block_and_the_next_steps_read_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ring_bytes: int | None
) -> None:
    """A disk error in one read (EIO) stops that step with the error; the block it was for is neither left in
    the ring as if copied (its region holds other bytes, and a ring holding every block copies a block once) nor
    held in its staging slot with the failed read, so the next steps read it again and are bitwise."""
    model, mapped = _mapped_stack(tmp_path)
    x = torch.randn(2, 7, 32)
    (reference,) = forward_steps(model, x, steps=1)
    read, reads = file_source.SliceReader.read, []

    def failing_once(self, parts):
        reads.append(len(parts))
        if len(reads) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return read(self, parts)

    monkeypatch.setattr(file_source.SliceReader, "read", failing_once)
    streamer = _streamer(mapped, range(6), ring=RingOptions(prefetch=1, ring_bytes=ring_bytes))
    streamer.enable()
    with pytest.raises(OSError, match="Input/output error"):
        forward_steps(mapped.module, x, steps=1)
    streamer.close_open_step()
    assert all(torch.equal(out, reference) for out in forward_steps(mapped.module, x, steps=3))
    streamer.disable()


def test_a_short_read_is_a_clear_error(tmp_path: Path) -> None:
    """A file that shrinks between the step's check and a read: the read itself says so."""
    _, mapped = _mapped_stack(tmp_path)
    source = next(iter(mapped.slices.values()))
    beyond = file_source.FileSlice(source.handle, os.path.getsize(mapped.path) - 4, 16, source.mapped)
    with pytest.raises(FileChangedError, match=r"stack.safetensors ended 12 bytes early.*load the model again"):
        file_source.read_slice(beyond, torch.empty(16, dtype=torch.uint8))


def describe_device(devices: Path, path: Path, rotational: str, partition: bool = False) -> None:
    """A block device description as Linux lays it out under ``/sys/dev/block``, at ``devices``, for the device
    ``path`` lies on: its queue's ``rotational`` flag, on the device itself or, for a partition, on its disk."""
    number = os.stat(path).st_dev
    disk = devices.parent / "devices" / "disk"
    device = disk / "part1" if partition else disk
    device.mkdir(parents=True, exist_ok=True)
    (disk / "queue").mkdir(exist_ok=True)
    (disk / "queue" / "rotational").write_text(f"{rotational}\n")
    devices.mkdir(parents=True, exist_ok=True)
    (devices / f"{os.major(number)}:{os.minor(number)}").symlink_to(device)


@pytest.mark.parametrize(
    ("rotational", "partition", "threads"),
    [("0", False, file_source.READ_THREADS), ("1", False, 1), ("1", True, 1), (None, False, file_source.READ_THREADS)],
    ids=["solid-state", "rotational", "rotational-disk-s-partition", "not-described"],
)
def test_files_on_a_disk_that_seeks_are_read_by_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rotational: str | None, partition: bool, threads: int
) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"0" * 4096)
    devices = tmp_path / "sys" / "dev" / "block"
    if rotational is not None:
        describe_device(devices, path, rotational, partition)
    monkeypatch.setattr(file_source, "SYS_BLOCK_DEVICES", devices)
    handle = os.open(path, os.O_RDONLY)
    try:
        assert file_source.read_threads([handle]) == threads
        monkeypatch.setattr(file_source, "POSITIONAL_READ", None)
        assert file_source.read_threads([handle]) == 1
    finally:
        os.close(handle)


def test_a_block_s_slices_are_read_by_several_threads_at_once_and_stream_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a solid-state disk, the file tier reads a block's slices (12 weights of 4 MiB here) in chunks on several
    threads at once, as ComfyUI's own Dynamic VRAM reader does: the first two positional reads wait for each other,
    which would time out if one thread read them in turn."""
    real_read, count = file_source.POSITIONAL_READ, itertools.count()
    both_reading = threading.Barrier(2, timeout=10)
    readers: set[int] = set()

    def positional_read(handle: int, buffers: list, offset: int) -> int:
        readers.add(threading.get_ident())
        if next(count) < 2:
            both_reading.wait()
        return real_read(handle, buffers, offset)

    model, mapped = _mapped_stack(tmp_path, blocks=2, dim=1024)
    describe_device(tmp_path / "sys" / "dev" / "block", mapped.path, "0")
    monkeypatch.setattr(file_source, "SYS_BLOCK_DEVICES", tmp_path / "sys" / "dev" / "block")
    monkeypatch.setattr(file_source, "POSITIONAL_READ", positional_read)
    x = torch.randn(1, 4, 1024)
    streamer = _streamer(mapped, range(2))
    streamer.enable()
    for out, expected in zip(forward_steps(mapped.module, x, steps=2), forward_steps(model, x, steps=2), strict=True):
        assert torch.equal(out, expected)
    report = streamer.report()
    assert report.bytes_read >= report.file_tier_bytes > 2 * 8 * 2**20, report.bytes_read
    assert len(readers) >= 2, readers
    streamer.disable()


def test_chunks_read_at_once_are_the_file_s_bytes_and_a_short_one_is_a_clear_error(tmp_path: Path) -> None:
    """Slices at odd offsets and of odd sizes, read in chunks of 1000 bytes by 4 threads, hold exactly the file's
    bytes; a slice running past the file's end fails with the file named, however its chunks fall."""
    path = tmp_path / "bytes.bin"
    content = os.urandom(100_003)
    path.write_bytes(content)
    handle = os.open(path, os.O_RDONLY)
    reader = file_source.SliceReader(threads=4, chunk=1000)
    try:
        unused = torch.empty(0, dtype=torch.uint8)
        spans = [(0, 1), (1, 4_999), (5_000, 45_001), (50_001, 50_002)]
        reads = [
            (file_source.FileSlice(handle, at, size, unused), torch.empty(size, dtype=torch.uint8))
            for at, size in spans
        ]
        assert reader.read(reads) == sum(size for _, size in spans)
        for (at, size), (_, destination) in zip(spans, reads, strict=True):
            assert bytes(destination.numpy()) == content[at : at + size]
        beyond = file_source.FileSlice(handle, 97_003, 5_500, unused)
        with pytest.raises(FileChangedError, match=r"bytes.bin ended 2500 bytes early at offset 100003"):
            reader.read([(beyond, torch.empty(5_500, dtype=torch.uint8))])
    finally:
        reader.close()
        os.close(handle)


def test_an_interrupt_while_chunks_are_read_raises_only_once_none_is_still_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C on the thread that reads a block into the spare buffer, while its chunks are read: the chunks not
    started are dropped and those under way finish before the interrupt goes on, so no thread writes into a
    buffer the next read reuses or frees (the chunks write through raw addresses)."""
    path = tmp_path / "bytes.bin"
    path.write_bytes(os.urandom(64_000))
    handle = os.open(path, os.O_RDONLY)
    writing: list[int] = []
    read_range, wait = file_source._read_range, file_source.wait

    def slowly(*args) -> None:
        writing.append(1)
        time.sleep(0.05)
        read_range(*args)
        writing.pop()

    def interrupted(futures, *args, **kwargs):
        monkeypatch.setattr(file_source, "wait", wait)
        raise KeyboardInterrupt

    monkeypatch.setattr(file_source, "_read_range", slowly)
    monkeypatch.setattr(file_source, "wait", interrupted)
    reader = file_source.SliceReader(threads=4, chunk=1000)
    try:
        unused = torch.empty(0, dtype=torch.uint8)
        with pytest.raises(KeyboardInterrupt):
            reader.read([(file_source.FileSlice(handle, 0, 64_000, unused), torch.empty(64_000, dtype=torch.uint8))])
        assert not writing, f"{len(writing)} chunks still writing after the interrupt"
    finally:
        reader.close()
        os.close(handle)


def test_the_timeline_has_a_read_lane(tmp_path: Path) -> None:
    _, mapped = _mapped_stack(tmp_path)
    recorder = TimelineRecorder(CPU)
    streamer = _streamer(mapped, range(6), recorder=recorder)
    streamer.enable()
    forward_steps(mapped.module, torch.randn(2, 7, 32), steps=3)
    step = recorder.latest()
    assert step.reads, "no read recorded"
    assert all(read.end >= read.start for read in step.reads)
    assert step.bytes_read > 0 and step.read_gbps > 0
    streamer.disable()


def test_the_sequential_wrapper_reads_modules_from_the_file(tmp_path: Path) -> None:
    model, mapped = _mapped_stack(tmp_path, blocks=3)
    x = torch.randn(2, 7, 32)
    reference = forward_steps(model, x, steps=2)
    from block_offload.offload import streamed_modules

    count = len(streamed_modules(mapped.module))
    wrapper = stream_modules(
        mapped.module,
        CPU,
        StreamSpec(files=FileOptions(file_slice=mapped.file_slice, read_each_step=range(count))),
        SequentialOptions(),
    )
    wrapper.enable()
    for out, expected in zip(forward_steps(mapped.module, x, steps=2), reference, strict=True):
        assert torch.equal(out, expected)
    wrapper.disable()
    assert all(mapped.mapped(tensor) for tensor in mapped.module.state_dict().values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16], ids=["fp32-file", "bf16-file"])
def test_on_cuda_the_file_tier_streams_bitwise_through_pinned_slots(tmp_path: Path, stored: torch.dtype) -> None:
    """Reader thread, pinned staging slots, the copy stream and its events, a cast on the device: the same
    output as the bf16 model resident on the GPU, with every other block read from the file."""
    cuda = torch.device("cuda")
    model = transformer_stack(num_blocks=8, dim=256).to(torch.bfloat16)
    mapped = MappedFile(copy.deepcopy(model), tmp_path / "stack.safetensors", stored)
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16, device=cuda)
    reference = forward_steps(model.to(cuda), x, steps=1)[0]
    for name, child in mapped.module.named_children():
        if name != "blocks":
            child.to(cuda, torch.bfloat16)  # the host's part: ComfyUI loads and casts it
    recorder = TimelineRecorder(cuda)
    streamer = _streamer(
        mapped,
        range(1, 8, 2),
        cuda,
        ring=RingOptions(prefetch=2),
        dtype_of=lambda module, name: torch.bfloat16,
        recorder=recorder,
    )
    streamer.enable()
    assert streamer.report().staging_bytes > 0 and streamer.files.pinned
    for out in forward_steps(mapped.module, x, steps=4):
        assert torch.equal(out, reference)
    # Each step reads blocks 1, 3, 5, 7. A read counts in the step open when it ends: on a GPU the host ends a step
    # before its reads do, so one step may show 2 and the next 6. Over the steps, every one was read each step.
    steps = recorder.steps
    assert sum(len(each.reads) for each in steps) >= 4 * (len(steps) - 1), [len(each.reads) for each in steps]
    step = recorder.latest()
    assert step.bytes_copied > 0
    print(
        f"\nfile tier on {torch.cuda.get_device_name()}: step {step.duration_ms:.2f} ms, copies "
        f"{step.bandwidth_gbps:.1f} GB/s, reads {step.read_gbps:.2f} GB/s, overlap {step.overlap:.2f}"
    )
    streamer.disable()
    assert all(mapped.mapped(tensor) for tensor in mapped.module.blocks.state_dict().values())


def test_content_written_into_host_buffers_parks_under_its_name_and_other_content_is_packed_from_the_file(
    tmp_path: Path,
) -> None:
    """What a host writes over blocks' weights in their host buffers (patches applied once): a streamer naming
    the same content adopts the parked buffers as they are; one naming none packs those blocks from the file
    again (the unwritten model's output), and adopts a plain buffer to write content into."""
    model, mapped = _mapped_stack(tmp_path)
    x = torch.randn(2, 7, 32)
    reference = forward_steps(model, x, steps=2)
    written = copy.deepcopy(model)
    for index in range(3):
        for tensor in written.blocks[index].parameters():
            tensor.data.add_(1.0)
    written_reference = forward_steps(written, x, steps=2)

    def streamer(contents: dict[int, str]) -> BlockStreamer:
        started = _streamer(
            mapped, read_each_step=(3,), host=HostOptions(contents=contents)
        )  # block 3 is read from the file
        started.enable()
        return started

    def hosts(started: BlockStreamer) -> dict[int, int]:
        return {index: state.host.data_ptr() for index, state in started.host.blocks.items() if state.read is None}

    def same_outputs(expected: list[torch.Tensor]) -> bool:
        outputs = forward_steps(mapped.module, x, steps=2)
        return all(torch.equal(out, want) for out, want in zip(outputs, expected, strict=True))

    plus_one = dict.fromkeys(range(3), "plus one")
    first = streamer(plus_one)
    assert first.report().needs_content == {0, 1, 2}
    for index in first.report().needs_content:
        for tensor in mapped.module.blocks[index].parameters():
            tensor.data.add_(1.0)  # the host buffer's views, on the host
    first.wrote_content(first.report().needs_content)
    assert first.report().needs_content == frozenset() and same_outputs(written_reference)
    packed = hosts(first)
    first.disable(park=True)

    again = streamer(plus_one)
    assert again.report().needs_content == frozenset() and hosts(again) == packed  # adopted as they are
    assert same_outputs(written_reference)
    again.disable(park=True)

    plain = streamer({})
    assert same_outputs(reference)  # blocks 0-2 packed from the file again
    assert {index: packed[index] for index in (4, 5)} == {index: hosts(plain)[index] for index in (4, 5)}
    kept = hosts(plain)
    plain.disable(park=True)

    into_plain = streamer({0: "plus one"})
    assert into_plain.report().needs_content == {0} and hosts(into_plain) == kept  # adopted, to be written
    with pytest.raises(ValueError, match="no originals in a file"):
        into_plain.host.options = replace(into_plain.host.options, contents={0: "plus one", 3: "plus one"})
        into_plain.wrote_content([3])  # read from the file at each step: it has no host buffer to hold content
    into_plain.disable()
    assert all(mapped.mapped(tensor) for tensor in mapped.module.state_dict().values())


def test_a_parked_buffer_from_the_file_that_is_not_adopted_is_packed_from_the_file_again(tmp_path: Path) -> None:
    """A streamer that cannot take a parked buffer over (here it stores another dtype, or reads the block from
    the file at each step) packs the block from its file, not from the parked buffer: the block keeps its
    file's views as originals, and holds no copy of its own once the streamer stops."""
    model, mapped = _mapped_stack(tmp_path)
    first = _streamer(mapped, read_each_step=())
    first.enable()
    first.disable(park=True)
    assert not any(mapped.mapped(tensor) for tensor in mapped.module.blocks.state_dict().values())  # parked
    second = _streamer(mapped, read_each_step=(), host=HostOptions(storage_dtype=torch.bfloat16))
    second.enable()
    assert all(state.file_backed for state in second.host.blocks.values())
    second.disable()
    assert all(mapped.mapped(tensor) for tensor in mapped.module.state_dict().values())
    # Parked again, then asked to be read from the file at each step: the file tier, not the parked buffer.
    third = _streamer(mapped, read_each_step=())
    third.enable()
    third.disable(park=True)
    fourth = _streamer(mapped, read_each_step=(0,))
    fourth.enable()
    assert fourth.host.blocks[0].read is not None and fourth.host.blocks[0].host.numel() == 0
    fourth.disable()
    assert all(mapped.mapped(tensor) for tensor in mapped.module.state_dict().values())
