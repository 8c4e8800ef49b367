/* Layouts shared by the agent's BPF programs and their Python reader (agent/maps.py mirrors
 * these with ctypes; a test checks the sizes). Nothing else defines them. */
#ifndef UNBROKEN_AGENT_H
#define UNBROKEN_AGENT_H

#define MAX_SLOTS 40 /* log2 buckets of nanoseconds: [2^i, 2^(i+1)) for i < MAX_SLOTS */

struct start_val {
    __u64 ts;
    __u32 fn;
    __u32 depth; /* traced calls nested inside this one (a runtime call's driver call) */
};

struct call_key {
    __u32 pid;
    __u32 fn;
};

/* Everything about one (pid, function): one map lookup per call. */
struct call_hist {
    __u64 count;
    __u64 sum_ns;
    __u64 slots[MAX_SLOTS];
};

struct sock_state {
    __u64 last_ts;
    __u32 pid;
    __u32 above;
};

struct tcp_stats {
    __u64 sends;
    __u64 above_ns;     /* socket-time spent at or above the threshold */
    __u64 last_permille; /* sk_wmem_queued / sk_sndbuf of the latest send, x1000 */
    __u64 peak_permille;
    __u64 last_ts;
    __u64 above_sends;
};

#endif
