// SPDX-License-Identifier: GPL-2.0
/* CUDA call latency: one uprobe/uretprobe pair serves every traced function; the function
 * id travels as the attach cookie. Each program comes twice: `cuda_enter`/`cuda_exit` for
 * one link per probe, `*_multi` loaded for multi-uprobe links (kernel 6.6+: one link per
 * library and direction, torn down with one grace period instead of one per probe). Latencies go into in-kernel log2 histograms per
 * (pid, function). A traced call made inside another traced call on the same thread (the
 * driver call inside a runtime call) is not counted a second time. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "agent.h"

char LICENSE[] SEC("license") = "GPL";

#define STALE_NS (5ULL * 1000000000ULL)

/* Per-thread open call: task-local storage, no hashing on the hot path. */
struct {
    __uint(type, BPF_MAP_TYPE_TASK_STORAGE);
    __uint(map_flags, BPF_F_NO_PREALLOC);
    __type(key, int);
    __type(value, struct start_val);
} starts SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 16384);
    __type(key, struct call_key);
    __type(value, struct call_hist);
} calls SEC(".maps");

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

static __always_inline int enter(struct pt_regs *ctx)
{
    struct start_val *s = bpf_task_storage_get(&starts, bpf_get_current_task_btf(), 0,
                                               BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (!s)
        return 0;
    __u64 now = bpf_ktime_get_ns();
    /* An open call older than STALE_NS is one whose return was never seen (its uretprobe
     * was attached after it entered, or it unwound another way): start over instead of
     * treating every later call as nested in it, which left a thread uncounted for good. */
    if (s->ts && now - s->ts < STALE_NS) {
        s->depth++;
        return 0;
    }
    s->fn = (__u32)bpf_get_attach_cookie(ctx);
    s->depth = 0;
    s->ts = now;
    return 0;
}

static __always_inline int leave(void)
{
    struct start_val *s = bpf_task_storage_get(&starts, bpf_get_current_task_btf(), 0, 0);
    if (!s || !s->ts)
        return 0;
    if (s->depth) {
        s->depth--;
        return 0;
    }
    __u64 delta = bpf_ktime_get_ns() - s->ts;
    struct call_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .fn = s->fn};
    s->ts = 0;

    __u32 slot = log2_u64(delta ? delta : 1);
    if (slot >= MAX_SLOTS)
        slot = MAX_SLOTS - 1;
    struct call_hist *h = bpf_map_lookup_elem(&calls, &key);
    if (!h) {
        struct call_hist zero = {};
        bpf_map_update_elem(&calls, &key, &zero, BPF_NOEXIST);
        h = bpf_map_lookup_elem(&calls, &key);
        if (!h)
            return 0;
    }
    __sync_fetch_and_add(&h->count, 1);
    __sync_fetch_and_add(&h->sum_ns, delta);
    __sync_fetch_and_add(&h->slots[slot], 1);
    return 0;
}

SEC("uprobe")
int cuda_enter(struct pt_regs *ctx)
{
    return enter(ctx);
}

SEC("uretprobe")
int cuda_exit(struct pt_regs *ctx)
{
    return leave();
}

SEC("uprobe")
int cuda_enter_multi(struct pt_regs *ctx)
{
    return enter(ctx);
}

SEC("uretprobe")
int cuda_exit_multi(struct pt_regs *ctx)
{
    return leave();
}
