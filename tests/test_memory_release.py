"""grpokit/train/memory.py: the allocator's free pages go back to the system, and only when there are enough."""

import contextlib

import pytest
import torch

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


def _embedding_model(tie=True, padding_idx=None):
    from grpokit.tiny import tiny_qwen2

    model = tiny_qwen2(vocab_size=300, hidden_size=16, num_layers=1)
    if not tie:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.get_input_embeddings().padding_idx = padding_idx
    return model


def _two_backwards(model, rows_into_grad: bool):
    """Gradients of two micro-batches' backwards (the second adds into the first's), each forward within
    `embedding_rows_into_grad` or not; and whether the embedding ran our function."""
    model.zero_grad(set_to_none=True)
    ran = []
    for ids in (torch.tensor([[5, 17, 5, 299, 0, 17]]), torch.tensor([[3, 3, 0, 8, 17, 250]])):
        scope = memory.embedding_rows_into_grad(model) if rows_into_grad else contextlib.nullcontext()
        with scope:
            out = model(ids).logits
            ran.append(out.grad_fn is not None and "forward" in vars(model.get_input_embeddings()))
        out.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().backward()
    assert "forward" not in vars(model.get_input_embeddings())  # restored
    return ran, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_rows_summed_into_the_gradient_equal_the_dense_gradient(tie, padding_idx):
    """The looked-up rows' gradients added into weight.grad in place (a padding_idx row gets none, as in
    F.embedding): the same gradients as autograd's dense embedding gradient, tied or not."""
    model = _embedding_model(tie, padding_idx)
    ran, in_place = _two_backwards(model, rows_into_grad=True)
    assert ran == [True, True]
    _, dense = _two_backwards(model, rows_into_grad=False)
    for name, grad in in_place.items():
        torch.testing.assert_close(grad, dense[name], rtol=1e-6, atol=1e-7)
    if padding_idx is not None and not tie:
        assert not in_place["model.embed_tokens.weight"][padding_idx].any()


def test_embedding_rows_into_grad_leaves_hooked_or_wrapped_embeddings_alone():
    model = _embedding_model()
    embedding = model.get_input_embeddings()
    handle = embedding.weight.register_hook(lambda grad: grad)
    with memory.embedding_rows_into_grad(model):
        assert "forward" not in vars(embedding)
    handle.remove()
    embedding.forward = wrapped = lambda ids: torch.nn.Embedding.forward(embedding, ids)  # another library's hook
    with memory.embedding_rows_into_grad(model):
        assert vars(embedding)["forward"] is wrapped
