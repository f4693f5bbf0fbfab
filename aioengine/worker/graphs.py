"""Decode steps padded to fixed batch-size buckets, replayed from CUDA graphs on CUDA.

Static input buffers sized for the largest bucket are filled in place each step; a batch of B
decode tokens runs as the next captured size Bp >= B, and rows B..Bp are padding that reads and
writes only the null block (block 0, never given to a request). On CUDA each bucket is a captured
graph sharing one memory pool. Eager (CPU), a batch runs at its own size from the same buffers:
there padding would only cost compute (10% more rows on the benchmark's decode steps), while the
tests turn ``pad`` on to cover its bookkeeping on CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from aioengine.messages import NULL_BLOCK_ID, ScheduledRequest
from aioengine.model.attention import AttentionMetadata
from aioengine.model.llama import LlamaForCausalLM
from aioengine.worker.step_inputs import DecodeBatch, padded_decode_inputs

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs`` (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


class PaddedDecodeRunner:
    """Runs decode-only steps at bucket sizes from static buffers (graph replay on CUDA)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        block_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
        use_graphs: bool,
        decode_kernel: Callable[..., None] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.use_graphs = use_graphs
        self.pad = use_graphs
        """Whether a batch runs at its bucket's size, padded: on where graphs replay (their shapes are fixed),
        off eager, where a batch runs at its own size."""
        self.decode_kernel = decode_kernel  # CPU only (see AttentionMetadata.decode_kernel); never captured
        n = self.sizes[-1]
        # Token ids, positions and KV slots: one buffer, so that a batch's rows (DecodeBatch.rows) copy in at once.
        self._rows = torch.zeros(3, n, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._rows.unbind(0)
        self.block_tables = torch.full((n, max_blocks_per_seq), NULL_BLOCK_ID, dtype=torch.long, device=device)
        self.mask = torch.zeros(n, 1, 1, max_blocks_per_seq * block_size, dtype=torch.bool, device=device)
        self.context_lens = torch.ones(n, dtype=torch.long, device=device)
        self._key_pos = torch.arange(max_blocks_per_seq * block_size, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[int, torch.Tensor] = {}
        self.pool: object | None = None
        self.capture_seconds = 0.0

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured size that holds ``batch_size``; None when it is larger than all."""
        i = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[i] if i < len(self.sizes) else None

    def batch(self, reqs: list[ScheduledRequest]) -> DecodeBatch:
        """``reqs`` (decodes, one token each) as a batch this runner takes: slots and tables at its block size, row
        groups only where it has no decode kernel."""
        return padded_decode_inputs(reqs, self.device, self.decode_kernel, self.block_size)

    def _meta(self, size: int, width: int, groups: list[tuple[torch.Tensor, int]] | None = None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            decode_block_tables=self.block_tables[:size, :width],
            decode_mask=self.mask[:size, :, :, : width * self.block_size],
            prefills=[],
            decode_groups=groups,
            decode_kernel=self.decode_kernel,
            decode_context_lens=self.context_lens[:size] if self.decode_kernel is not None else None,
        )

    def _forward(self, size: int, width: int, groups: list[tuple[torch.Tensor, int]] | None = None) -> torch.Tensor:
        return self.model.compute_logits(self._hidden(size, width, groups))

    def _hidden(self, size: int, width: int, groups: list[tuple[torch.Tensor, int]] | None = None) -> torch.Tensor:
        return self.model.final_hidden(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_caches,
            self._meta(size, width, groups),
            None,  # every row: the padded rows' too, dropped after
        )

    def _fill(self, batch: DecodeBatch, size: int) -> None:
        """Copies a batch into the static buffers; rows past the batch become null-block padding."""
        b, width = batch.block_tables.shape
        self._rows[:, :b].copy_(batch.rows)
        if size > b:  # token 0 at position 0, written to the null block's first slot
            self._rows[:2, b:size].zero_()
            self.slot_mapping[b:size].fill_(NULL_BLOCK_ID * self.block_size)
        if size > b or self.use_graphs:  # a graph reads every row, every table entry
            self.block_tables[:size].fill_(NULL_BLOCK_ID)
        self.block_tables[:b, :width].copy_(batch.block_tables)
        # Padded rows attend to position 0 of the null block only: finite, and ignored.
        if self.decode_kernel is not None:
            torch.add(self.positions[:size], 1, out=self.context_lens[:size])
        else:
            torch.lt(self._key_pos.unsqueeze(0), self.positions[:size].unsqueeze(1) + 1, out=self.mask[:size, 0, 0])

    @torch.inference_mode()
    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits [B, V] of a decode batch of B <= max_batch_size tokens. ``batch.groups`` (eager only; ignored on
        graph replay) splits the real rows by context length."""
        size = self._filled(batch)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.graph_outputs[size][: batch.size]
        # Eager (CPU): only as wide as this batch's longest block table.
        return self._forward(size, batch.block_tables.shape[1], batch.groups)[: batch.size]

    @torch.inference_mode()
    def run_hidden(self, batch: DecodeBatch) -> torch.Tensor:
        """``run`` without the lm_head, eager only: the final norm's rows [B, H] (``model.final_hidden``)."""
        if self.use_graphs:
            raise RuntimeError("run_hidden is eager only: with CUDA graphs the captured forward ends in the logits")
        size = self._filled(batch)
        return self._hidden(size, batch.block_tables.shape[1], batch.groups)[: batch.size]

    def _filled(self, batch: DecodeBatch) -> int:
        """The batch copied into the static buffers; returns the size it runs at."""
        size = self.bucket(batch.size)
        assert size is not None, f"decode batch {batch.size} exceeds the largest bucket {self.max_batch_size}"
        size = size if self.pad else batch.size
        self._fill(batch, size)
        return size

    @torch.inference_mode()
    def capture(self) -> float:
        """Captures one CUDA graph per size (largest first, one shared pool); returns seconds taken."""
        if not self.use_graphs:
            return 0.0
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._fill(DecodeBatch(self._rows[:, :0], self.block_tables[:0, :1]), size)
            for _ in range(2):  # warm-up outside the graph: lazy inits and allocator state
                self._forward(size, self.max_blocks)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.graph_outputs[size] = self._forward(size, self.max_blocks)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (sizes %s) in %.2fs", len(self.graphs), self.sizes, self.capture_seconds)
        return self.capture_seconds

    def release(self) -> None:
        """Drops the graphs (sleep without virtual-address preservation must recapture after wake)."""
        self.graphs.clear()
        self.graph_outputs.clear()
        self.pool = None
