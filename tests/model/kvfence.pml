/*
 * kvfence.pml: the release proof, as a Promela model that spin checks
 * exhaustively (tests/model/README.md).
 *
 * Three nodes, two rooms, TCP-like transfers: room 0 moves one frame from a
 * source on n0 into sink pages on n1, room 1 from a source on n2 into sink
 * pages on n0. A frame written by a source sits in the sink's kernel socket
 * buffer until the sink's receiver reads it; the receiver checks its own copy
 * of the lease (admission) and then writes the pages (two steps, a receive in
 * progress in between). The world may pause a node (it takes no step until
 * resumed: what SIGSTOP, a VM pause or a cgroup freeze do) and kill a node (its
 * socket buffers go with it; its death is then witnessed on its host).
 *
 * The network. Every message in flight (a notice to a node, a report to the
 * control plane) is one bit: "this message is on its way". A receiver takes
 * any message that is on its way to it, in any order (reordering); the
 * network may lose any of them (losses, bounded by MAX_LOSSES to keep the
 * search finite); the control plane re-sends every pending abort notice and
 * fence, unbounded, as the daemon does, so a node gets a notice again after it
 * handled it (duplication). A report delivered twice is the same as once:
 * every report's handling below only sets flags, so the second copy changes
 * nothing, and one bit stands for any number of copies. A set instead of a
 * FIFO per link is what makes the search exhaustive on a small machine: a
 * FIFO of k messages stores every order of them, and the daemons do not rely
 * on that order for safety (a node takes notices from several threads). A
 * control-plane crash loses what is in flight and nothing of its state (the
 * log): the same as losses here; the schedule explorer drives the real log
 * replay.
 *
 * The invariants, named like the schedule explorer's (tests/explorer):
 *   I1  no lease is RELEASED while a live op touches its pages: a sink frame
 *       lands, or a source reads its pages for a frame, only while the lease
 *       is not RELEASED;
 *   I4  each lease is released once, and only when its room is terminal;
 *   END when nothing can move any more, every room is terminal and every
 *       lease RELEASED (no room waits for ever: a paused node resumes, a dead
 *       node's death is witnessed).
 *
 * The rule under test: a participant is quiescent when its own node reported
 * Drained (admission closed, no op in flight: a receive in progress is an op)
 * or a proof from its host came in (the node's death witnessed, or the node
 * itself reporting that it fenced itself, which it can only do once it runs
 * again). Fencing by peers proves only for pages on the peers' hosts.
 * Build with -DOLD_RULE for the rule before issue 12 (a LOST participant
 * fenced by its peers counts as quiescent) and with -DOLD_RECV for a sink
 * whose receive in progress is not an op of the room: spin then finds the
 * paused-sink and the overlapping-receive releases.
 *
 * State-space notes: every step is one atomic block and leaves no local
 * variable behind (loop counters are reset), so a state is the globals and
 * the processes' loop heads; -DCOLLAPSE compresses it losslessly.
 */

#define NN 3 /* nodes */
#define NR 2 /* rooms */
#define NP 4 /* participants: room r has source 2r and sink 2r+1 */

#define ACTIVE    1
#define ABORTING  2
#define ABORTED   3
#define COMPLETED 4

#define SRC(r)  (2 * (r))
#define SNK(r)  (2 * (r) + 1)
#define ROOM(p) ((p) / 2)

byte node_of[NP];
byte peer_of[NP]; /* the other participant of the room */

/* Control plane: durable (its log), so a crash keeps all of this. */
byte rstate[NR];
bool drained[NP], completed[NP], released[NP];
#ifdef OLD_RULE
bool pfenced[NP]; /* every peer of p's node fenced it (acknowledged) */
#endif
bool lost[NN];
bool witnessed[NN]; /* the node's death, witnessed on its host */
bool hostproof[NN]; /* the node said it fenced itself */

/* Messages on their way (one bit each, see the network above). */
bool n_abort[NP];  /* AbortNotice for participant p, to node_of[p] */
bool n_fence[NP];  /* FencePeer about participant p, to node_of[peer_of[p]] */
bool r_drained[NP], r_done[NP]; /* reports about participant p */
#ifdef OLD_RULE
bool r_pfenced[NP];
#endif
bool r_self[NN];   /* node n: "I fenced myself" */

/* Nodes. */
bool alive[NN], paused[NN];
bool adm[NP];       /* the node's lifetime of the participant: admission open */
byte ops[NP];       /* ops in flight: a source's send, a sink's receive */
bool want_drain[NP];
bool sent[NP];      /* source: its frame is out */
byte landed[NP];    /* sink: frames written into its pages */
bool conn_closed[NR]; /* the room's TCP connection was closed by a fence */
byte buf[NR];       /* frames in the sink's kernel socket buffer */
bool selffenced[NN];

/* Bounds on what the world does, to keep the state space finite. */
byte pauses, kills, losses;
/* -DKILL_NODE=n: only node n may be killed (to split a search in three). */
#ifdef KILL_NODE
#define KILLABLE(n) ((n) == KILL_NODE)
#else
#define KILLABLE(n) true
#endif
#ifndef MAX_PAUSES
#define MAX_PAUSES 1
#endif
#ifndef MAX_KILLS
#define MAX_KILLS 1
#endif
/* -DPAUSE_NODE=n: only node n may be paused (to look at one case). */
#ifdef PAUSE_NODE
#define PAUSABLE(n) ((n) == PAUSE_NODE)
#else
#define PAUSABLE(n) true
#endif
#ifndef MAX_LOSSES
#define MAX_LOSSES 1
#endif

#define running(n) (alive[n] && !paused[n])

#ifdef OLD_RULE
#define QUIESCENT(p) (drained[p] || witnessed[node_of[p]] || hostproof[node_of[p]] || \
                      (lost[node_of[p]] && pfenced[p]))
#else
#define QUIESCENT(p) (drained[p] || witnessed[node_of[p]] || hostproof[node_of[p]])
#endif

inline release_room(r) {
    assert(!released[SRC(r)] && !released[SNK(r)]); /* I4 */
    released[SRC(r)] = true;
    released[SNK(r)] = true;
    /* Read only while the room runs: reset, so that states differing only
     * in them are one state. */
    drained[SRC(r)] = false; drained[SNK(r)] = false;
    completed[SRC(r)] = false; completed[SNK(r)] = false
}

inline abort_room(r) {
    if
    :: rstate[r] == ACTIVE ->
        rstate[r] = ABORTING;
        completed[SRC(r)] = false; /* read only while ACTIVE */
        completed[SNK(r)] = false;
        n_abort[SRC(r)] = true;
        n_abort[SNK(r)] = true
    :: else -> skip
    fi
}

/* ---- the control plane ------------------------------------------------------------- */

/* A node whose session is gone (paused or dead: it says nothing) is LOST:
 * its rooms abort and its peers are told to fence it. No timer ever
 * releases: this only aborts and fences. */
inline declare_lost(x) {
    lost[x] = true;
    for (p : 0 .. NP - 1) {
        if
        :: node_of[p] == x -> abort_room(ROOM(p)); n_fence[p] = true
        :: else -> skip
        fi
    }
    p = 0
}

/* Take report FLAG (or lose it on the way) and do WHAT with it. */
#define TAKE(FLAG, WHAT) \
    atomic { FLAG -> FLAG = false; \
        if \
        :: WHAT \
        :: losses < MAX_LOSSES -> losses++ \
        fi }

inline on_done(P) {
    if
    :: rstate[ROOM(P)] == ACTIVE ->
        completed[P] = true;
        if
        :: completed[peer_of[P]] -> rstate[ROOM(P)] = COMPLETED; release_room(ROOM(P))
        :: else -> skip
        fi
    :: else -> skip
    fi
}

/* Re-send a pending notice (a duplicate when the node had it already, the
 * notice again when it was lost): never bounded, as in the daemon. A fence is
 * re-sent until acknowledged; under the rule nothing reads the
 * acknowledgement, so it is re-sent until the connection is closed, after
 * which a fence changes nothing. */
#define RESEND_ABORT(P) \
    atomic { rstate[ROOM(P)] == ABORTING && !drained[P] && !n_abort[P] -> n_abort[P] = true }
#ifdef OLD_RULE
#define RESEND_FENCE(P) \
    atomic { lost[node_of[P]] && !pfenced[P] && !n_fence[P] -> n_fence[P] = true }
#else
#define RESEND_FENCE(P) \
    atomic { lost[node_of[P]] && !conn_closed[ROOM(P)] && !n_fence[P] -> n_fence[P] = true }
#endif

proctype control()
{
    byte p;
end:
    do
    :: TAKE(r_drained[0], drained[0] = (rstate[0] == ABORTING))
    :: TAKE(r_drained[1], drained[1] = (rstate[0] == ABORTING))
    :: TAKE(r_drained[2], drained[2] = (rstate[1] == ABORTING))
    :: TAKE(r_drained[3], drained[3] = (rstate[1] == ABORTING))
    :: TAKE(r_done[0], on_done(0))
    :: TAKE(r_done[1], on_done(1))
    :: TAKE(r_done[2], on_done(2))
    :: TAKE(r_done[3], on_done(3))
#ifdef OLD_RULE
    :: TAKE(r_pfenced[0], pfenced[0] = true)
    :: TAKE(r_pfenced[1], pfenced[1] = true)
    :: TAKE(r_pfenced[2], pfenced[2] = true)
    :: TAKE(r_pfenced[3], pfenced[3] = true)
#endif
    :: TAKE(r_self[0], hostproof[0] = true)
    :: TAKE(r_self[1], hostproof[1] = true)
    :: TAKE(r_self[2], hostproof[2] = true)
    /* ABORTING -> ABORTED once every participant is quiescent. */
    :: atomic { rstate[0] == ABORTING && QUIESCENT(SRC(0)) && QUIESCENT(SNK(0)) ->
                rstate[0] = ABORTED; release_room(0) }
    :: atomic { rstate[1] == ABORTING && QUIESCENT(SRC(1)) && QUIESCENT(SNK(1)) ->
                rstate[1] = ABORTED; release_room(1) }
    :: RESEND_ABORT(0)
    :: RESEND_ABORT(1)
    :: RESEND_ABORT(2)
    :: RESEND_ABORT(3)
    :: RESEND_FENCE(0)
    :: RESEND_FENCE(1)
    :: RESEND_FENCE(2)
    :: RESEND_FENCE(3)
    :: atomic { !lost[0] && (paused[0] || !alive[0]) -> declare_lost(0) }
    :: atomic { !lost[1] && (paused[1] || !alive[1]) -> declare_lost(1) }
    :: atomic { !lost[2] && (paused[2] || !alive[2]) -> declare_lost(2) }
    od
}

/* ---- a node ------------------------------------------------------------------------ */

inline maybe_drained(p) {
    if
    :: want_drain[p] && ops[p] == 0 && !adm[p] -> r_drained[p] = true
    :: else -> skip
    fi
}

/* A notice on its way to this node may also be lost instead of taken. */
#define LOSE(FLAG) \
    :: losses < MAX_LOSSES -> losses++; FLAG = false

/* An abort notice for participant P (the node takes its notices in any order). */
inline on_abort(P) {
    atomic {
        running(me) && node_of[P] == me && n_abort[P] ->
        if
        :: n_abort[P] = false;
           adm[P] = false;
           want_drain[P] = true;
           maybe_drained(P)
        LOSE(n_abort[P])
        fi
    }
}

/* FencePeer about participant P: close the room's connection to P's node. As
 * the sink, the receiver is joined first (no receive in progress) and the
 * kernel drops what was buffered; as the source, the bytes already in the
 * sink's buffer stay there: closing a socket cannot recall them. */
inline on_fence(P) {
    atomic {
        running(me) && node_of[peer_of[P]] == me && n_fence[P] &&
        (P != SRC(ROOM(P)) || ops[SNK(ROOM(P))] == 0) ->
        if
        :: n_fence[P] = false;
           conn_closed[ROOM(P)] = true;
           if
           :: P == SRC(ROOM(P)) -> buf[ROOM(P)] = 0
           :: else -> skip
           fi
#ifdef OLD_RULE
           ; r_pfenced[P] = true
#endif
        LOSE(n_fence[P])
        fi
    }
}

/* Source of room R: read the pages into a frame (an op), then write it. */
inline send_start(R) {
    atomic {
        running(me) && node_of[SRC(R)] == me && adm[SRC(R)] && !sent[SRC(R)] &&
        ops[SRC(R)] == 0 && !conn_closed[R] ->
        ops[SRC(R)] = 1
    }
}
inline send_end(R) {
    atomic {
        running(me) && node_of[SRC(R)] == me && ops[SRC(R)] > 0 ->
        assert(!released[SRC(R)]); /* I1: the source's pages are read now */
        if
        :: !conn_closed[R] && alive[node_of[SNK(R)]] -> buf[R]++
        :: else -> skip
        fi;
        ops[SRC(R)] = 0;
        sent[SRC(R)] = true;
        if
        :: adm[SRC(R)] -> r_done[SRC(R)] = true
        :: else -> maybe_drained(SRC(R))
        fi
    }
}

/* Sink of room R: take a frame off the socket, check the lease, land it. */
#ifdef OLD_RECV
#define RECEIVING(R) (landed[SNK(R)] >= 100)
#else
#define RECEIVING(R) (ops[SNK(R)] > 0)
#endif
inline recv_start(R) {
    atomic {
        running(me) && node_of[SNK(R)] == me && buf[R] > 0 && !RECEIVING(R) ->
        buf[R]--;
        if
        :: adm[SNK(R)] ->
#ifdef OLD_RECV
            landed[SNK(R)] = landed[SNK(R)] + 100 /* in progress, but not an op */
#else
            ops[SNK(R)]++
#endif
        :: else -> skip /* refused: the lifetime is closed */
        fi
    }
}
inline recv_end(R) {
    atomic {
        running(me) && node_of[SNK(R)] == me && RECEIVING(R) ->
        assert(!released[SNK(R)]); /* I1: the frame lands in the sink's pages */
#ifdef OLD_RECV
        landed[SNK(R)] = landed[SNK(R)] - 99;
#else
        ops[SNK(R)]--;
        landed[SNK(R)]++;
#endif
        if
        :: adm[SNK(R)] && landed[SNK(R)] == 1 -> r_done[SNK(R)] = true
        :: else -> maybe_drained(SNK(R))
        fi
    }
}

#define IDLE(p) (node_of[p] != me || (ops[p] == 0 && landed[p] < 100))

proctype node(byte me)
{
    byte p;
end:
    do
    :: on_abort(0)
    :: on_abort(1)
    :: on_abort(2)
    :: on_abort(3)
    :: on_fence(0)
    :: on_fence(1)
    :: on_fence(2)
    :: on_fence(3)
    :: send_start(0)
    :: send_start(1)
    :: send_end(0)
    :: send_end(1)
    :: recv_start(0)
    :: recv_start(1)
    :: recv_end(0)
    :: recv_end(1)
    /* Back after being declared LOST: the session is refused, so the node
     * fences itself (lifetimes closed, receivers joined, sockets closed) and
     * then says so: a proof from its own host. */
    :: atomic {
        running(me) && lost[me] && !selffenced[me] && IDLE(0) && IDLE(1) && IDLE(2) && IDLE(3) ->
        for (p : 0 .. NP - 1) {
            if
            :: node_of[p] == me ->
                adm[p] = false;
                if
                :: p == SNK(ROOM(p)) -> buf[ROOM(p)] = 0; conn_closed[ROOM(p)] = true
                :: else -> skip
                fi
            :: else -> skip
            fi
        }
        p = 0;
        selffenced[me] = true;
        r_self[me] = true
       }
    od
}

/* ---- the world --------------------------------------------------------------------- */

/* kill -9: the process, its ops and its socket buffers are gone. */
inline kill(x) {
    kills++;
    alive[x] = false;
    paused[x] = false;
    for (p : 0 .. NP - 1) {
        if
        :: node_of[p] == x ->
            adm[p] = false;
            ops[p] = 0;
            landed[p] = landed[p] % 100;
            if
            :: p == SNK(ROOM(p)) -> buf[ROOM(p)] = 0
            :: else -> skip
            fi
        :: else -> skip
        fi
    }
    p = 0
}

proctype world()
{
    byte p;
end:
    do
    :: atomic { PAUSABLE(0) && pauses < MAX_PAUSES && alive[0] -> pauses++; paused[0] = true }
    :: atomic { PAUSABLE(1) && pauses < MAX_PAUSES && alive[1] -> pauses++; paused[1] = true }
    :: atomic { PAUSABLE(2) && pauses < MAX_PAUSES && alive[2] -> pauses++; paused[2] = true }
    :: atomic { paused[0] -> paused[0] = false }
    :: atomic { paused[1] -> paused[1] = false }
    :: atomic { paused[2] -> paused[2] = false }
    :: atomic { KILLABLE(0) && kills < MAX_KILLS && alive[0] -> kill(0) }
    :: atomic { KILLABLE(1) && kills < MAX_KILLS && alive[1] -> kill(1) }
    :: atomic { KILLABLE(2) && kills < MAX_KILLS && alive[2] -> kill(2) }
    /* Its death is witnessed on its host (the lock it held is free). */
    :: atomic { !alive[0] && !witnessed[0] -> witnessed[0] = true }
    :: atomic { !alive[1] && !witnessed[1] -> witnessed[1] = true }
    :: atomic { !alive[2] && !witnessed[2] -> witnessed[2] = true }
    /* An engine aborts a room. */
    :: atomic { rstate[0] == ACTIVE -> abort_room(0) }
    :: atomic { rstate[1] == ACTIVE -> abort_room(1) }
    od
}

/* END: when nothing can move, every room is terminal and its leases released. */
proctype ending()
{
    timeout ->
    assert((rstate[0] == ABORTED || rstate[0] == COMPLETED) &&
           (rstate[1] == ABORTED || rstate[1] == COMPLETED));
    assert(released[0] && released[1] && released[2] && released[3])
}

init {
    atomic {
        node_of[SRC(0)] = 0; node_of[SNK(0)] = 1;
        node_of[SRC(1)] = 2; node_of[SNK(1)] = 0;
        peer_of[0] = 1; peer_of[1] = 0; peer_of[2] = 3; peer_of[3] = 2;
        byte i;
        for (i : 0 .. NN - 1) { alive[i] = true }
        for (i : 0 .. NP - 1) { adm[i] = true }
        rstate[0] = ACTIVE; rstate[1] = ACTIVE;
        run control(); run node(0); run node(1); run node(2); run world(); run ending()
    }
}
