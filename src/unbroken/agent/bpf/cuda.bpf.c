// SPDX-License-Identifier: GPL-2.0
/* CUDA call latency: one uprobe/uretprobe pair serves every traced function; the function
 * id travels as the attach cookie. Latencies go into in-kernel log2 histograms per
 * (pid, function). A traced call made inside another traced call on the same thread (the
 * driver call inside a runtime call) is not counted a second time. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "agent.h"

char LICENSE[] SEC("license") = "GPL";

struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 65536);
    __type(key, __u64);
    __type(value, struct start_val);
} starts SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 65536);
    __type(key, struct hist_key);
    __type(value, __u64);
} hists SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 16384);
    __type(key, struct total_key);
    __type(value, struct total_val);
} totals SEC(".maps");

static __always_inline __u32 log2_u32(__u32 v)
{
    __u32 r, shift;
    r = (v > 0xFFFF) << 4; v >>= r;
    shift = (v > 0xFF) << 3; v >>= shift; r |= shift;
    shift = (v > 0xF) << 2; v >>= shift; r |= shift;
    shift = (v > 0x3) << 1; v >>= shift; r |= shift;
    r |= (v >> 1);
    return r;
}

static __always_inline __u32 log2_u64(__u64 v)
{
    __u32 hi = v >> 32;
    return hi ? log2_u32(hi) + 32 : log2_u32((__u32)v);
}

SEC("uprobe")
int cuda_enter(struct pt_regs *ctx)
{
    __u64 tid = bpf_get_current_pid_tgid();
    struct start_val *s = bpf_map_lookup_elem(&starts, &tid);
    if (s) {
        s->depth++;
        return 0;
    }
    struct start_val v = {.ts = bpf_ktime_get_ns(), .fn = (__u32)bpf_get_attach_cookie(ctx)};
    bpf_map_update_elem(&starts, &tid, &v, BPF_ANY);
    return 0;
}

SEC("uretprobe")
int cuda_exit(struct pt_regs *ctx)
{
    __u64 tid = bpf_get_current_pid_tgid();
    struct start_val *s = bpf_map_lookup_elem(&starts, &tid);
    if (!s)
        return 0;
    if (s->depth) {
        s->depth--;
        return 0;
    }
    __u64 delta = bpf_ktime_get_ns() - s->ts;
    __u32 fn = s->fn;
    bpf_map_delete_elem(&starts, &tid);

    __u32 slot = log2_u64(delta ? delta : 1);
    if (slot >= MAX_SLOTS)
        slot = MAX_SLOTS - 1;
    struct hist_key hk = {.pid = tid >> 32, .fn = fn, .slot = slot};
    __u64 one = 1, *cnt = bpf_map_lookup_elem(&hists, &hk);
    if (cnt)
        __sync_fetch_and_add(cnt, 1);
    else
        bpf_map_update_elem(&hists, &hk, &one, BPF_NOEXIST);

    struct total_key tk = {.pid = tid >> 32, .fn = fn};
    struct total_val *t = bpf_map_lookup_elem(&totals, &tk);
    if (t) {
        __sync_fetch_and_add(&t->count, 1);
        __sync_fetch_and_add(&t->sum_ns, delta);
    } else {
        struct total_val tv = {.count = 1, .sum_ns = delta};
        bpf_map_update_elem(&totals, &tk, &tv, BPF_NOEXIST);
    }
    return 0;
}
