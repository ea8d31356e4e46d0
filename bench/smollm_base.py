"""The base SmolLM2-135M-Instruct on the word_math task (recipe smollm2_math_cpu): how often it writes "Answer: ..."
(format rate), its held-out accuracy by the DAPO rule, response lengths; greedy and T=1 samples, HF transformers.

    nice -n 19 .venv/bin/python bench/smollm_base.py [--prompts 64] [--max-new 160] [--dtype bf16] [--max-ops 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--max-ops", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--samples", type=int, default=1, help="T=1 samples per prompt (0: greedy only)")
    ap.add_argument("--show", type=int, default=3)
    ap.add_argument("--no-greedy", action="store_true", help="only the T=1 samples")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.data.word_math import eval_rows
    from megatron_dapo.models.gguf import cached_hf_dir, smollm2_gguf
    from megatron_dapo.reward.math_dapo import compute_score

    torch.manual_seed(0)
    path = cached_hf_dir(smollm2_gguf())
    tok = load_tokenizer(path)
    tok.padding_side = "left"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    rows = eval_rows(args.prompts, args.max_ops)
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    out = {"prompts": len(rows), "dtype": args.dtype, "max_new": args.max_new, "max_ops": args.max_ops}
    for mode, n in (("greedy", 1), ("t1", args.samples)):
        if n == 0 or (mode == "greedy" and args.no_greedy):
            continue
        t0, recs, new_tokens = time.perf_counter(), [], 0
        for i in range(0, len(rows), args.batch):
            enc = tok(prompts[i : i + args.batch], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                gen = model.generate(**enc, max_new_tokens=args.max_new, do_sample=mode == "t1", temperature=1.0,
                                     top_p=1.0, num_return_sequences=n, pad_token_id=tok.pad_token_id)  # fmt: skip
            resp = gen[:, enc["input_ids"].shape[1] :]
            for j, ids in enumerate(resp):
                row = rows[i + j // n]
                ids = [t for t in ids.tolist() if t != tok.pad_token_id]
                new_tokens += len(ids)
                text = tok.decode(ids, skip_special_tokens=True)
                r = compute_score(text, row["reward_model"]["ground_truth"])
                recs.append({"steps": row["extra_info"]["steps"], "len": len(ids), "text": text,
                             "truth": row["reward_model"]["ground_truth"], **r})  # fmt: skip
        dt = time.perf_counter() - t0
        res = {"format": sum(not r["invalid"] for r in recs) / len(recs), "acc": sum(r["acc"] for r in recs) / len(recs),
               "mean_len": sum(r["len"] for r in recs) / len(recs), "truncated": sum(r["len"] >= args.max_new
               for r in recs) / len(recs), "tok_per_s": new_tokens / dt, "seconds": dt}  # fmt: skip
        for k in range(1, args.max_ops + 1):
            sub = [r for r in recs if r["steps"] == k]
            res[f"acc_{k}_steps"] = sum(r["acc"] for r in sub) / max(1, len(sub))
        out[mode] = res
        # the number after the last "=" or "is": right arithmetic, whatever the format (not the reward)
        res["acc_lenient"] = sum(_last_number(r["text"]) == str(r["truth"]) for r in recs) / len(recs)
        for r in recs[: args.show]:
            print(f"--- {mode} acc={r['acc']} pred={r['pred']}\n{r['text']}", flush=True)
        print(json.dumps({mode: res}), flush=True)
    print(json.dumps(out, indent=1))


def _last_number(text: str) -> str | None:
    import re

    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


if __name__ == "__main__":
    main()
