// SPDX-License-Identifier: GPL-2.0
/* TCP backpressure per process, from the kernel's own chrono: the time each socket was
 * limited by the peer's receive window (TCP_CHRONO_RWND_LIMITED: the peer is not reading)
 * or by its own send buffer (TCP_CHRONO_SNDBUF_LIMITED), in jiffies, as tcp_info reports.
 * A send buffer's fill ratio alone misses a slow reader: autotuning grows sk_sndbuf to
 * tcp_wmem[2] (4 MB here) and a streaming writer rarely fills it.
 *
 * - tp_btf/tcp_sendmsg_locked: first sight of a socket records its owner (the sending pid)
 *   and the chrono's value then; keeps the per-process peak fill ratio.
 * - tp_btf/inet_sock_set_state: when the user closes the socket (or it is reset), what it
 *   accrued is credited to its process, while the process's entry still exists.
 * - collect (raw_tp, run by the agent with BPF_PROG_TEST_RUN at each scrape): refreshes the
 *   live values of every open socket, including an interval still open (a stall in progress
 *   counts while it lasts, not at the next send). */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "agent.h"

char LICENSE[] SEC("license") = "GPL";

enum { ESTABLISHED = 1, SYN_SENT = 2, SYN_RECV = 3, CLOSE_WAIT = 8, LISTEN = 10 };

extern int CONFIG_HZ __kconfig __weak;

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

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct tcp_clock);
} clock SEC(".maps");

/* tcp_get_info_chrono_stats(): the stored total plus the interval still open. */
static __always_inline void chrono(struct sock *sk, __u32 now, __u32 *rwnd, __u32 *sndbuf)
{
    struct tcp_sock *tp = (struct tcp_sock *)sk;
    __u32 type = BPF_CORE_READ_BITFIELD_PROBED(tp, chrono_type);
    __u32 start = BPF_CORE_READ(tp, chrono_start);
    __u32 r = BPF_CORE_READ(tp, chrono_stat[TCP_CHRONO_RWND_LIMITED - 1]);
    __u32 s = BPF_CORE_READ(tp, chrono_stat[TCP_CHRONO_SNDBUF_LIMITED - 1]);
    if (type == TCP_CHRONO_RWND_LIMITED)
        r += now - start;
    else if (type == TCP_CHRONO_SNDBUF_LIMITED)
        s += now - start;
    *rwnd = r;
    *sndbuf = s;
}

static __always_inline __u32 fill_permille(struct sock *sk)
{
    int queued = BPF_CORE_READ(sk, sk_wmem_queued);
    int sndbuf = BPF_CORE_READ(sk, sk_sndbuf);
    if (sndbuf <= 0 || queued <= 0)
        return 0;
    /* sk_wmem_queued may overshoot sk_sndbuf by one skb's truesize: clamp to "full". */
    __u64 p = (__u64)queued * 1000 / (__u64)sndbuf;
    return p > 1000 ? 1000 : (__u32)p;
}

static __always_inline void credit(struct sock_state *st, struct sock *sk, __u32 now)
{
    __u32 r, s;
    __u32 pid = st->pid;
    struct tcp_stats *ps = bpf_map_lookup_elem(&tcp_pids, &pid);
    if (!ps)
        return; /* the process was forgotten (exited): nothing exports it any more */
    chrono(sk, now, &r, &s);
    __sync_fetch_and_add(&ps->closed_rwnd, (__u32)(r - st->base_rwnd));
    __sync_fetch_and_add(&ps->closed_sndbuf, (__u32)(s - st->base_sndbuf));
}

SEC("tp_btf/tcp_sendmsg_locked")
int BPF_PROG(on_sendmsg, struct sock *sk, struct msghdr *msg, struct sk_buff *skb, int size_goal)
{
    __u32 pid = bpf_get_current_pid_tgid() >> 32;
    __u32 now = (__u32)bpf_jiffies64();
    __u32 permille = fill_permille(sk);
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
    if (!st) {
        struct sock_state v = {.pid = pid, .permille = permille};
        chrono(sk, now, &v.base_rwnd, &v.base_sndbuf);
        bpf_map_update_elem(&socks, &key, &v, BPF_ANY);
    } else if (st->pid != pid) {
        /* Another process sends on it now (fork, fd passing): the first keeps what
         * accrued while it owned the socket. */
        credit(st, sk, now);
        chrono(sk, now, &st->base_rwnd, &st->base_sndbuf);
        st->rwnd = st->sndbuf = 0;
        st->pid = pid;
    }
    __sync_fetch_and_add(&ps->sends, 1);
    if (permille > ps->peak_permille)
        ps->peak_permille = permille;
    return 0;
}

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(on_state, struct sock *sk, int oldstate, int newstate)
{
    /* Still the user's socket in these states; any other means closed (FIN_WAIT1 or
     * LAST_ACK from close(), CLOSE on a reset): the process's part ends here. What an
     * orphaned socket does after its process closed it is nobody's backpressure. */
    if (newstate == ESTABLISHED || newstate == SYN_SENT || newstate == SYN_RECV ||
        newstate == CLOSE_WAIT || newstate == LISTEN)
        return 0;
    __u64 key = (__u64)sk;
    struct sock_state *st = bpf_map_lookup_elem(&socks, &key);
    if (!st)
        return 0;
    credit(st, sk, (__u32)bpf_jiffies64());
    bpf_map_delete_elem(&socks, &key);
    return 0;
}

static long refresh(struct bpf_map *map, __u64 *key, struct sock_state *st, __u32 *now)
{
    struct sock *sk = (struct sock *)*key;
    __u32 r, s;
    chrono(sk, *now, &r, &s);
    st->rwnd = r - st->base_rwnd;
    st->sndbuf = s - st->base_sndbuf;
    st->permille = fill_permille(sk);
    __u32 pid = st->pid;
    struct tcp_stats *ps = bpf_map_lookup_elem(&tcp_pids, &pid);
    if (ps && st->permille > ps->peak_permille)
        ps->peak_permille = st->permille;
    return 0;
}

SEC("raw_tp")
int collect(void *ctx)
{
    __u32 zero = 0;
    __u32 now = (__u32)bpf_jiffies64();
    bpf_for_each_map_elem(&socks, refresh, &now, 0);
    struct tcp_clock *c = bpf_map_lookup_elem(&clock, &zero);
    if (c) {
        c->hz = CONFIG_HZ;
        c->jiffies = bpf_jiffies64();
        c->ktime_ns = bpf_ktime_get_ns();
    }
    return 0;
}
