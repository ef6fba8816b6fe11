"""Row 1 of the GPU check: each Triton kernel against its torch reference."""

from __future__ import annotations

from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup


def check_kernels(s: Setup) -> None:
    import torch

    from engine.attention import reference
    from engine.attention.metadata import AttentionMetadata
    from engine.kernels.decode_attention import decode_attention, num_splits_for
    from engine.kernels.prefill_attention import default_config, plan_tiles, prefill_attention
    from engine.kernels.store_kv import store_kv
    from engine.kv_cache.layout import cache_shape, layer_view

    dtype = getattr(torch, s.dtype)
    torch.manual_seed(0)
    bs, kv, groups = 16, s.kv_heads, s.heads // s.kv_heads
    for head_dim in (64, 128):
        # (new tokens, context): decodes on and past block boundaries, long decodes
        # that split, fresh prompts, chunks after cached prefixes.
        case = [(1, 1), (1, 16), (1, 17), (1, 700), (1, s.bw_context), (37, 37), (64, 200), (5, 1111)]
        if s.device == "cpu":
            case = [(1, 1), (1, 17), (1, 70), (9, 9), (7, 40)]
        nblocks = [-(-n // bs) for _, n in case]
        # Layer 1 of a 2-layer cache in the engine's layout: the strides the kernels get.
        cache = layer_view(torch.full(cache_shape(sum(nblocks) + 4, kv, 2, bs, head_dim), float("nan"),
                                      dtype=dtype, device=s.device), 1)
        perm = torch.randperm(cache.shape[0]).tolist()
        tables = torch.zeros((len(case), max(nblocks)), dtype=torch.int32)
        slots_new, ks, vs = [], [], []
        for i, ((q_len, n), nb) in enumerate(zip(case, nblocks)):
            tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
            pos = torch.arange(n)
            slots = (tables[i].long()[pos // bs] * bs + pos % bs).to(s.device)
            k = torch.randn(n, kv, head_dim, device=s.device).to(dtype)
            v = torch.randn(n, kv, head_dim, device=s.device).to(dtype)
            reference.store_kv(cache, k[:n - q_len], v[:n - q_len], slots[:n - q_len])
            slots_new.append(slots[n - q_len:]), ks.append(k[n - q_len:]), vs.append(v[n - q_len:])
        key, value = torch.cat(ks), torch.cat(vs)
        slot_mapping = torch.cat(slots_new)
        expected_cache = cache.clone()
        reference.store_kv(expected_cache, key, value, slot_mapping)
        store_kv(cache, key, value, slot_mapping)
        same = torch.equal(cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))
        row(f"store_kv d{head_dim}", "bit-exact" if same else "differs", "bit-exact", same)

        q_lens = [q for q, _ in case]
        query = torch.randn(sum(q_lens), kv * groups, head_dim, device=s.device).to(dtype)
        starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        md = AttentionMetadata(slot_mapping, starts.to(s.device),
                               torch.tensor([n for _, n in case], dtype=torch.int32, device=s.device),
                               tables.to(s.device), q_lens, [n for _, n in case])
        expected = reference.paged_attention(query.float(), cache.float(), md, head_dim ** -0.5)
        out = torch.full_like(query, float("nan"))
        decode = [i for i, q in enumerate(q_lens) if q == 1]
        prefill = [i for i, q in enumerate(q_lens) if q > 1]
        index = torch.tensor(decode, device=s.device)
        decode_attention(out, query, cache, starts[decode].to(s.device), md.block_tables[index].contiguous(),
                         md.seq_lens[index].contiguous(), head_dim ** -0.5,
                         num_splits_for(max(case[i][1] for i in decode)))
        tile_seq, tile_start = plan_tiles(q_lens, prefill, default_config(cache.device).block_m)
        prefill_attention(out, query, cache, md.block_tables, md.seq_lens, md.query_start_loc,
                          torch.from_numpy(tile_seq).to(s.device), torch.from_numpy(tile_start).to(s.device),
                          head_dim ** -0.5)
        for name, rows in (("decode", decode), ("prefill", prefill)):
            tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rows]).to(s.device)
            got, ref = out[tokens].float(), expected[tokens]
            err = ((got - ref).norm() / ref.norm()).item()
            ok = not got.isnan().any().item() and err <= 1e-2
            row(f"{name} attention d{head_dim} ({s.dtype})", f"rel err {err:.1e}", "<= 1e-2", ok)
        # The decode rows again with the 8k-context splits of a CUDA graph, shared by every
        # program count: a program looping over splits must give the same bits.
        decode_rows = starts[decode].to(s.device), md.block_tables[index].contiguous(), md.seq_lens[index].contiguous()
        splits = num_splits_for(8192)
        outs = []
        for programs in (splits, 2, 1):
            out = torch.full_like(query, float("nan"))
            decode_attention(out, query, cache, *decode_rows, head_dim ** -0.5, splits, split_programs=programs)
            outs.append(out[decode_rows[0].long()])
        same = all(torch.equal(o, outs[0]) for o in outs[1:]) and not outs[0].isnan().any().item()
        row(f"decode d{head_dim}, {splits} splits: 2 or 1 programs == one per split", "identical" if same
            else "differ", "identical", same)
    check_norm_rope(s)


def check_norm_rope(s: Setup) -> None:
    """The fused norm, rotary and SiLU-and-mul kernels against the model's torch ops."""
    import torch

    from engine.kernels.norm_rope import add_rms_norm, rotary_
    from engine.model.norm import RMSNorm
    from engine.model.rope import RotaryEmbedding, apply_rotary

    dtype, head_dim = getattr(torch, s.dtype), s.hidden // s.heads
    torch.manual_seed(0)
    norm = RMSNorm(s.hidden, 1e-5).to(s.device, dtype)
    norm.weight.data.normal_()
    x, residual = (torch.randn(300, s.hidden, device=s.device).to(dtype) for _ in range(2))
    out, summed = add_rms_norm(x, norm.weight, 1e-5, residual)
    ref = norm(x + residual).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ok = torch.equal(summed, x + residual) and err <= 1e-2
    row(f"fused add + RMSNorm ({s.dtype})", f"rel err {err:.1e}", "<= 1e-2", ok)
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None, s.device)
    positions = torch.randint(0, 4096, (300,), device=s.device)
    q = torch.randn(300, s.heads, head_dim, device=s.device).to(dtype)
    k = torch.randn(300, s.kv_heads, head_dim, device=s.device).to(dtype)
    want_q, want_k = apply_rotary(q.float(), k.float(), *rope.lookup(positions, torch.float32))
    rotary_(q, k, rope.cos, rope.sin, positions)
    err = max(((a.float() - b).norm() / b.norm()).item() for a, b in ((q, want_q), (k, want_k)))
    row(f"fused rotary ({s.dtype})", f"rel err {err:.1e}", "<= 1e-2", err <= 1e-2)
    from engine.kernels.activation import silu_and_mul

    gate_up = torch.randn(300, 2 * 4 * s.hidden, device=s.device).to(dtype)  # I = 4 x hidden
    gate, up = gate_up.float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    err = ((silu_and_mul(gate_up).float() - ref).norm() / ref.norm()).item()
    row(f"fused SiLU-and-mul ({s.dtype})", f"rel err {err:.1e}", "<= 1e-2", err <= 1e-2)
