#!/usr/bin/env python3
"""Time fla's Triton kernels on the shapes kda_gpu_check benchmarks, then print the
side-by-side table (shape, ours ms, fla ms, ratio, % of floor).

    python3 bench/gpu/fla_bench.py --ours kda_gpu_bench.tsv [--out table.md] [--only-kda]
                                   [--budget SECONDS]

--budget: no new op is timed after this many seconds (the table is printed with what was
measured; fla's rows come in order of the issue's targets: forward, layer fwd+bwd, decode, then
the plain fwd+bwd pairs, whose first call autotunes for minutes).
--only-kda: the KDA chunked rows alone (no GDN, no decode; kda_gpu_check's KDA_BENCH_ONLY=kda).
--only-gdn: fla's Gated DeltaNet forward rows alone.
--flashkda: also time Moonshot's FlashKDA forward (`import flash_kda`, built beside the
checkout; not part of this repository) on the KDA layer's inputs, as a second table against our
chunk_fwd_kda_layer rows. --no-fla: skip fla (FlashKDA alone).

fla is imported from PYTHONPATH (scripts/gpu_run.sh points it at gpu_carry/ when present).
If fla cannot be imported, only our numbers are printed, and the script says so.
Timings: triton.testing.do_bench, median, after warm-up; bf16 inputs, H = HV = 32,
K = V = 128, initial state none, final state returned (forward), states in a 1024-slot fp32
pool updated in place (KDA decode). Forward + backward: torch autograd through chunk_kda /
chunk_gated_delta_rule with the layer options off (gates and betas given, no in-kernel l2norm),
o and the final state back-propagated from random do, dht (as kda_gpu_check does).
chunk_fwd_kda_layer: chunk_kda with the KDA layer's in-kernel options (use_qk_l2norm_in_kernel,
use_gate_in_kernel with A_log, dt_bias, safe_gate and lower_bound = -5,
use_beta_sigmoid_in_kernel) on raw q, k, gate and beta logits; chunk_fwdbwd_kda_layer: the same
through autograd, gradients to q, k, v, g, beta, A_log and dt_bias (fp32 leaves).
"""
import argparse
import signal
import sys
import time

H, K, V = 32, 128, 128
CHUNK_SHAPES = [(8, 2048), (2, 8192), (1, 65536)]
DECODE_BATCHES = [1, 16, 64, 128]


def read_ours(path):
    ours, ceilings = {}, {}
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if parts[0] == "ceiling":
                ceilings[parts[1]] = float(parts[2])
            elif len(parts) == 4:
                ours[(parts[0], parts[1])] = (float(parts[2]), float(parts[3]))
    return ours, ceilings


class OutOfTime(BaseException):  # not caught by the per-op `except Exception`
    pass


def _on_term(signum, frame):  # `timeout` sends SIGTERM: keep what was measured so far
    raise OutOfTime()


DEADLINE = [float("inf")]  # time.time() past which no new op is timed (--budget)


def time_fla(results, only_kda=False, only_gdn=False):
    import torch
    import torch.nn.functional as F
    import triton

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    dev, bf = "cuda", torch.bfloat16

    def bench(fn, grad_to_none=None, warmup=50, rep=300):
        # past the budget: stop here and print what was measured (a first call of an op can
        # spend minutes in Triton's autotuning, which no signal interrupts cleanly)
        if time.time() > DEADLINE[0]:
            raise OutOfTime()
        try:
            return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                           return_mode="median")
        except Exception as e:  # one broken op must not lose the others
            print(f"fla op failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return None

    def fmt(x, unit=1.0):
        return "failed" if x is None else f"{x * unit:.3f}"

    def fwd_bwd(name, B, T):
        key = f"{B}x{T}"
        gate_shape, fn = ((B, T, H, K), chunk_kda) if name == "kda" else \
            ((B, T, H), chunk_gated_delta_rule)
        q = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf).requires_grad_()
        k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf).requires_grad_()
        v = torch.randn(B, T, H, V, device=dev, dtype=bf).requires_grad_()
        beta = (torch.rand(B, T, H, device=dev, dtype=bf) * 0.8 + 0.1).requires_grad_()
        g = (-(torch.rand(*gate_shape, device=dev) * 0.99 + 0.01)).to(bf).requires_grad_()
        do = torch.randn(B, T, H, V, device=dev, dtype=bf)
        dht = torch.randn(B, H, K, V, device=dev, dtype=torch.float32) * 0.1
        leaves = [q, k, v, g, beta]

        def step():
            o, ht = fn(q, k, v, g, beta, output_final_state=True)
            torch.autograd.backward((o, ht), (do, dht))
        results[(f"chunk_fwdbwd_{name}", key)] = bench(step, grad_to_none=leaves, warmup=25,
                                                       rep=150)
        print(f"fla fwd+bwd {name} {key}: {fmt(results[(f'chunk_fwdbwd_{name}', key)])} ms",
              flush=True)
        del q, k, v, beta, g, do, dht, leaves
        torch.cuda.empty_cache()

    def fwd_bwd_layer(B, T):  # the KDA layer's in-kernel options, as chunk_fwd_kda_layer
        key = f"{B}x{T}"
        qr = torch.randn(B, T, H, K, device=dev, dtype=bf).requires_grad_()
        kr = torch.randn(B, T, H, K, device=dev, dtype=bf).requires_grad_()
        v = torch.randn(B, T, H, V, device=dev, dtype=bf).requires_grad_()
        graw = torch.randn(B, T, H, K, device=dev, dtype=bf).requires_grad_()
        braw = torch.randn(B, T, H, device=dev, dtype=bf).requires_grad_()
        A_log = torch.zeros(H, device=dev, dtype=torch.float32).requires_grad_()
        dt_bias = (torch.rand(H * K, device=dev, dtype=torch.float32) - 0.5).requires_grad_()
        do = torch.randn(B, T, H, V, device=dev, dtype=bf)
        dht = torch.randn(B, H, K, V, device=dev, dtype=torch.float32) * 0.1
        leaves = [qr, kr, v, graw, braw, A_log, dt_bias]

        def step():
            o, ht = chunk_kda(qr, kr, v, graw, braw, A_log=A_log, dt_bias=dt_bias,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                              output_final_state=True)
            torch.autograd.backward((o, ht), (do, dht))
        name = "chunk_fwdbwd_kda_layer"
        results[(name, key)] = bench(step, grad_to_none=leaves, warmup=25, rep=150)
        print(f"fla fwd+bwd kda layer {key}: {fmt(results[(name, key)])} ms", flush=True)
        del qr, kr, v, graw, braw, A_log, dt_bias, do, dht, leaves
        torch.cuda.empty_cache()

    torch.manual_seed(0)
    with torch.inference_mode():
        for B, T in CHUNK_SHAPES:
            q = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf)
            k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf)
            v = torch.randn(B, T, H, V, device=dev, dtype=bf)
            beta = torch.rand(B, T, H, device=dev, dtype=bf) * 0.8 + 0.1
            gk = -(torch.rand(B, T, H, K, device=dev) * 0.99 + 0.01).to(bf)
            g = -(torch.rand(B, T, H, device=dev) * 0.99 + 0.01).to(bf)
            key = f"{B}x{T}"
            if only_gdn:  # the Gated DeltaNet forward rows alone
                results[("chunk_fwd_gdn", key)] = bench(
                    lambda: chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True))
                print(f"fla chunk {key}: gdn {fmt(results[('chunk_fwd_gdn', key)])} ms", flush=True)
                del q, k, v, beta, g, gk
                torch.cuda.empty_cache()
                continue
            results[("chunk_fwd_kda", key)] = bench(
                lambda: chunk_kda(q, k, v, gk, beta, output_final_state=True))
            # the KDA layer's anchor: in-kernel l2norm, gate (safe_gate, lower_bound -5) and
            # sigmoid(beta) from raw inputs (kda_gpu_check's chunk_fwd_kda_layer)
            qr = torch.randn(B, T, H, K, device=dev, dtype=bf)
            kr = torch.randn(B, T, H, K, device=dev, dtype=bf)
            graw = torch.randn(B, T, H, K, device=dev, dtype=bf)
            braw = torch.randn(B, T, H, device=dev, dtype=bf)
            A_log = torch.zeros(H, device=dev, dtype=torch.float32)
            dt_bias = torch.rand(H * K, device=dev, dtype=torch.float32) - 0.5
            results[("chunk_fwd_kda_layer", key)] = bench(
                lambda: chunk_kda(qr, kr, v, graw, braw, A_log=A_log, dt_bias=dt_bias,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, safe_gate=True,
                                  lower_bound=-5.0, output_final_state=True))
            print(f"fla chunk {key}: kda layer options "
                  f"{fmt(results[('chunk_fwd_kda_layer', key)])} ms", flush=True)
            del gk, qr, kr, graw, braw
            if not only_kda:
                results[("chunk_fwd_gdn", key)] = bench(
                    lambda: chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True))
            gdn = "skipped" if only_kda else fmt(results[("chunk_fwd_gdn", key)])
            print(f"fla chunk {key}: kda {fmt(results[('chunk_fwd_kda', key)])} ms, gdn {gdn} ms",
                  flush=True)
            del q, k, v, beta, g
            torch.cuda.empty_cache()

    if only_gdn:
        return results
    # forward + backward through autograd with the KDA layer's options (the target), then
    # decode, then the plain KDA and GDN pairs (fla's plain KDA backward autotunes for minutes)
    for B, T in CHUNK_SHAPES:
        fwd_bwd_layer(B, T)
    if only_kda:
        for B, T in CHUNK_SHAPES:
            fwd_bwd("kda", B, T)
        return results

    with torch.inference_mode():
        slots_n = 1024
        pool = torch.zeros(slots_n, H, K, V, device=dev, dtype=torch.float32)
        for B in DECODE_BATCHES:
            q = F.normalize(torch.randn(B, 1, H, K, device=dev), dim=-1).to(bf)
            k = F.normalize(torch.randn(B, 1, H, K, device=dev), dim=-1).to(bf)
            v = torch.randn(B, 1, H, V, device=dev, dtype=bf)
            beta = torch.rand(B, 1, H, device=dev, dtype=bf) * 0.8 + 0.1
            gk = -(torch.rand(B, 1, H, K, device=dev) * 0.49 + 0.01).to(bf)
            g = -(torch.rand(B, 1, H, device=dev) * 0.49 + 0.01).to(bf)
            sets = [torch.randperm(slots_n, device=dev)[:B].to(torch.int32) for _ in range(16)]
            it = [0]

            def kda_step():
                it[0] += 1
                fused_recurrent_kda_fwd(q, k, v, gk, beta, scale=K ** -0.5, initial_state=pool,
                                        inplace_final_state=True,
                                        ssm_state_indices=sets[it[0] % 16])
            results[("decode_kda", f"B{B}")] = bench(kda_step)
            # fla's GDN recurrent kernel has no slot indices: contiguous states in and out
            h0 = torch.randn(B, H, K, V, device=dev, dtype=torch.float32)
            results[("decode_gdn", f"B{B}")] = bench(
                lambda: fused_recurrent_gated_delta_rule_fwd(
                    q, k, v, g=g, beta=beta, scale=K ** -0.5, initial_state=h0,
                    output_final_state=True))
            print(f"fla decode B={B}: kda {fmt(results[('decode_kda', f'B{B}')], 1e3)} us, "
                  f"gdn {fmt(results[('decode_gdn', f'B{B}')], 1e3)} us", flush=True)
    for B, T in CHUNK_SHAPES:
        fwd_bwd("kda", B, T)
    for B, T in CHUNK_SHAPES:
        fwd_bwd("gdn", B, T)
    return results


def time_flashkda(results):
    """FlashKDA's fwd on the same raw layer inputs as fla's chunk_fwd_kda_layer anchor: raw q, k
    (l2-normalised inside), gate logits with A_log = 0, dt_bias uniform(-0.5, 0.5),
    lower_bound = -5, beta logits, scale K^-0.5, final state written (fp32)."""
    import torch
    import triton
    import flash_kda

    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    with torch.inference_mode():
        for B, T in CHUNK_SHAPES:
            key = f"{B}x{T}"
            q = torch.randn(B, T, H, K, device=dev, dtype=bf)
            k = torch.randn(B, T, H, K, device=dev, dtype=bf)
            v = torch.randn(B, T, H, V, device=dev, dtype=bf)
            graw = torch.randn(B, T, H, K, device=dev, dtype=bf)
            braw = torch.randn(B, T, H, device=dev, dtype=bf)
            A_log = torch.zeros(H, device=dev, dtype=torch.float32)
            dt_bias = torch.rand(H, K, device=dev, dtype=torch.float32) - 0.5
            out = torch.empty(B, T, H, V, device=dev, dtype=bf)
            ht = torch.empty(B, H, V, K, device=dev, dtype=torch.float32)
            results[("chunk_fwd_kda_layer", key)] = triton.testing.do_bench(
                lambda: flash_kda.fwd(q, k, v, graw, braw, K ** -0.5, out, A_log, dt_bias, -5.0,
                                      final_state=ht),
                warmup=50, rep=300, return_mode="median")
            print(f"FlashKDA fwd {key}: {results[('chunk_fwd_kda_layer', key)]:.3f} ms",
                  flush=True)
            del q, k, v, graw, braw, out, ht
            torch.cuda.empty_cache()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--out")
    ap.add_argument("--only-kda", action="store_true")
    ap.add_argument("--only-gdn", action="store_true")
    ap.add_argument("--flashkda", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds after which no new op is timed (0: no limit)")
    args = ap.parse_args()
    if args.budget > 0:
        DEADLINE[0] = time.time() + args.budget
    ours, ceilings = read_ours(args.ours)
    signal.signal(signal.SIGTERM, _on_term)
    flk = {}
    if args.flashkda:
        try:
            time_flashkda(flk)
        except Exception as e:  # keep the rest
            print(f"FlashKDA NOT timed ({type(e).__name__}: {str(e)[:300]})", flush=True)
    flk_lines = []  # also written to --out, after fla's table (a cut-off log cannot lose them)
    if flk:
        flk_lines = ["", "| op | shape | ours ms | FlashKDA ms | ours/FlashKDA |",
                     "|---|---|---|---|---|"]
        for (op, shape), ms in flk.items():
            mine = ours.get((op, shape))
            if mine:
                flk_lines.append(f"| {op} | {shape} | {mine[0]:.4f} | {ms:.4f} | "
                                 f"{mine[0] / ms:.2f} |")
        print("\n".join(flk_lines) + "\n", flush=True)
    fla = {}
    try:
        if args.no_fla:
            raise ImportError("--no-fla")
        time_fla(fla, args.only_kda, args.only_gdn)
        fla_note = "fla timed in this run"
    except OutOfTime:
        fla_note = "fla timed in this run (cut short by the time limit)"
    except ImportError as e:
        fla_note = f"fla NOT timed (import failed: {e}); put fla/ in gpu_carry/"
    except Exception as e:  # keep our numbers even if fla breaks
        fla_note = f"fla NOT timed ({type(e).__name__}: {e})"

    lines = [f"copy {ceilings.get('copy_tbs', 0):.2f} TB/s, bf16 GEMM "
             f"{ceilings.get('gemm_tflops', 0):.0f} TFLOP/s (measured this run); {fla_note}",
             "",
             "| op | shape | ours ms | fla ms | ours/fla | % of floor (floor ms) |",
             "|---|---|---|---|---|---|"]
    for (op, shape), (ms, floor_ms) in ours.items():
        f = fla.get((op, shape))
        fla_s = f"{f:.4f}" if f is not None else "-"
        ratio = f"{ms / f:.2f}" if f else "-"
        lines.append(f"| {op} | {shape} | {ms:.4f} | {fla_s} | {ratio} | "
                     f"{100 * floor_ms / ms:.0f}% ({floor_ms:.4f}) |")
    table = "\n".join(lines + flk_lines)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    sys.exit(main())
