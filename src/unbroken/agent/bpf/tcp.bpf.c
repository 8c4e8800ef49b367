// SPDX-License-Identifier: GPL-2.0
/* TCP send-buffer backpressure per process: at every tcp_sendmsg_locked (a BTF tracepoint:
 * kprobes are often disabled) read sk_wmem_queued and sk_sndbuf; keep, per process, the
 * latest and peak fill ratio and the time sockets spent at or above a threshold. Socket state
 * is dropped when the socket closes. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "agent.h"

char LICENSE[] SEC("license") = "GPL";

#define TCP_CLOSE_STATE 7

const volatile __u32 threshold_permille = 800;

struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 65536);
    __type(key, __u64);
    __type(value, struct sock_state);
} socks SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 16384);
    __type(key, __u32);
    __type(value, struct tcp_stats);
} tcp_pids SEC(".maps");

SEC("tp_btf/tcp_sendmsg_locked")
int BPF_PROG(on_sendmsg, struct sock *sk, struct msghdr *msg, struct sk_buff *skb, int size_goal)
{
    __u32 pid = bpf_get_current_pid_tgid() >> 32;
    int queued = BPF_CORE_READ(sk, sk_wmem_queued);
    int sndbuf = BPF_CORE_READ(sk, sk_sndbuf);
    if (sndbuf <= 0 || queued < 0)
        return 0;
    __u64 permille = (__u64)queued * 1000 / (__u64)sndbuf;
    __u64 now = bpf_ktime_get_ns();
    __u32 above = permille >= threshold_permille;
    __u64 key = (__u64)sk;

    struct tcp_stats *ps = bpf_map_lookup_elem(&tcp_pids, &pid);
    if (!ps) {
        struct tcp_stats zero = {};
        bpf_map_update_elem(&tcp_pids, &pid, &zero, BPF_NOEXIST);
        ps = bpf_map_lookup_elem(&tcp_pids, &pid);
        if (!ps)
            return 0;
    }
    struct sock_state *st = bpf_map_lookup_elem(&socks, &key);
    if (st) {
        if (st->above)
            __sync_fetch_and_add(&ps->above_ns, now - st->last_ts);
        st->last_ts = now;
        st->above = above;
    } else {
        struct sock_state v = {.last_ts = now, .pid = pid, .above = above};
        bpf_map_update_elem(&socks, &key, &v, BPF_ANY);
    }
    __sync_fetch_and_add(&ps->sends, 1);
    if (above)
        __sync_fetch_and_add(&ps->above_sends, 1);
    ps->last_permille = permille;
    if (permille > ps->peak_permille)
        ps->peak_permille = permille;
    ps->last_ts = now;
    return 0;
}

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(on_state, struct sock *sk, int oldstate, int newstate)
{
    if (newstate != TCP_CLOSE_STATE)
        return 0;
    __u64 key = (__u64)sk;
    struct sock_state *st = bpf_map_lookup_elem(&socks, &key);
    if (!st)
        return 0;
    if (st->above) {
        __u32 pid = st->pid;
        struct tcp_stats *ps = bpf_map_lookup_elem(&tcp_pids, &pid);
        if (ps)
            __sync_fetch_and_add(&ps->above_ns, bpf_ktime_get_ns() - st->last_ts);
    }
    bpf_map_delete_elem(&socks, &key);
    return 0;
}
