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
 * resumed: what SIGSTOP, a VM pause or a cgroup freeze do), kill a node (its
 * socket buffers go with it; its death is then witnessed on its host), lose
 * and duplicate the control plane's notices (re-sends) and the nodes' reports,
 * and deliver a node's messages out of order. A control-plane crash loses
 * what is in flight and nothing of its state (the log): the same as losses,
 * which the schedule explorer drives with the real log replay.
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

mtype = { ABORT, FENCE, DRAINED, DONE, PEERFENCED, SELFFENCED };

byte node_of[NP];
byte peer_of[NP]; /* the other participant of the room */

/* Control plane: durable (its log), so a crash keeps all of this. */
byte rstate[NR];
bool drained[NP], completed[NP], released[NP], pfenced[NP];
bool lost[NN];
bool witnessed[NN]; /* the node's death, witnessed on its host */
bool hostproof[NN]; /* the node said it fenced itself */

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

chan tonode[NN] = [2] of { mtype, byte }; /* notice, participant */
chan tocp = [3] of { mtype, byte };       /* report, participant or node */

#define running(n) (alive[n] && !paused[n])

/* A report to the control plane, which the network may lose. */
inline report(kind, what) {
    if
    :: losses < MAX_LOSSES -> losses++
    :: nfull(tocp) -> tocp ! kind, what
    :: full(tocp) -> skip /* backed up: dropped; a duplicate notice gets it again */
    fi
}

#ifdef OLD_RULE
#define QUIESCENT(p) (drained[p] || witnessed[node_of[p]] || hostproof[node_of[p]] || \
                      (lost[node_of[p]] && pfenced[p]))
#else
#define QUIESCENT(p) (drained[p] || witnessed[node_of[p]] || hostproof[node_of[p]])
#endif

inline release_room(r) {
    assert(!released[SRC(r)] && !released[SNK(r)]); /* I4 */
    released[SRC(r)] = true;
    released[SNK(r)] = true
}

/* A notice; one that finds the queue full is lost (a re-send brings it). */
inline notify(n, kind, what) {
    if
    :: nfull(tonode[n]) -> tonode[n] ! kind, what
    :: full(tonode[n]) -> skip
    fi
}

inline abort_room(r) {
    if
    :: rstate[r] == ACTIVE ->
        rstate[r] = ABORTING;
        notify(node_of[SRC(r)], ABORT, SRC(r));
        notify(node_of[SNK(r)], ABORT, SNK(r))
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
        :: node_of[p] == x -> abort_room(ROOM(p)); notify(node_of[peer_of[p]], FENCE, p)
        :: else -> skip
        fi
    }
}

inline resend(P) {
    atomic {
        rstate[ROOM(P)] == ABORTING && !drained[P] && !(tonode[node_of[P]] ?? [ABORT, P]) ->
        notify(node_of[P], ABORT, P)
    }
}

proctype control()
{
    byte p, x;
    mtype kind;
end:
    do
    :: atomic {
        tocp ? kind, p ->
        if
        :: kind == DRAINED -> drained[p] = true
        :: kind == DONE && rstate[ROOM(p)] == ACTIVE ->
            completed[p] = true;
            if
            :: completed[peer_of[p]] -> rstate[ROOM(p)] = COMPLETED; release_room(ROOM(p))
            :: else -> skip
            fi
        :: kind == PEERFENCED -> pfenced[p] = true /* p: the fenced participant */
        :: kind == SELFFENCED -> hostproof[p] = true /* p: the node */
        :: else -> skip
        fi
       }
    /* ABORTING -> ABORTED once every participant is quiescent. */
    :: atomic { rstate[0] == ABORTING && QUIESCENT(SRC(0)) && QUIESCENT(SNK(0)) ->
                rstate[0] = ABORTED; release_room(0) }
    :: atomic { rstate[1] == ABORTING && QUIESCENT(SRC(1)) && QUIESCENT(SNK(1)) ->
                rstate[1] = ABORTED; release_room(1) }
    /* Re-send a pending notice (duplicates, and lost ones again): never
     * bounded, as in the daemon, but only while none is queued. */
    :: resend(0)
    :: resend(1)
    :: resend(2)
    :: resend(3)
    :: atomic { !lost[0] && (paused[0] || !alive[0]) -> x = 0; declare_lost(x) }
    :: atomic { !lost[1] && (paused[1] || !alive[1]) -> x = 1; declare_lost(x) }
    :: atomic { !lost[2] && (paused[2] || !alive[2]) -> x = 2; declare_lost(x) }
    od
}

/* ---- a node ------------------------------------------------------------------------ */

inline maybe_drained(p) {
    if
    :: want_drain[p] && ops[p] == 0 && !adm[p] -> report(DRAINED, p)
    :: else -> skip
    fi
}

/* An abort notice for participant P (the node takes its notices in any order). */
inline on_abort(P) {
    atomic {
        running(me) && tonode[me] ?? [ABORT, P] ->
        tonode[me] ?? ABORT, eval(P);
        adm[P] = false;
        want_drain[P] = true;
        maybe_drained(P)
    }
}

/* FencePeer about participant P: close the room's connection to P's node. As
 * the sink, the receiver is joined first (no receive in progress) and the
 * kernel drops what was buffered; as the source, the bytes already in the
 * sink's buffer stay there: closing a socket cannot recall them. */
inline on_fence(P) {
    atomic {
        running(me) && tonode[me] ?? [FENCE, P] && (P != SRC(ROOM(P)) || ops[SNK(ROOM(P))] == 0) ->
        tonode[me] ?? FENCE, eval(P);
        conn_closed[ROOM(P)] = true;
        if
        :: P == SRC(ROOM(P)) -> buf[ROOM(P)] = 0
        :: else -> skip
        fi;
        report(PEERFENCED, P)
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
        :: adm[SRC(R)] -> report(DONE, SRC(R))
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
        :: adm[SNK(R)] && landed[SNK(R)] == 1 -> report(DONE, SNK(R))
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
        selffenced[me] = true;
        report(SELFFENCED, me)
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
}

proctype world()
{
    byte x, p;
end:
    do
    :: atomic { PAUSABLE(0) && pauses < MAX_PAUSES && alive[0] -> pauses++; paused[0] = true }
    :: atomic { PAUSABLE(1) && pauses < MAX_PAUSES && alive[1] -> pauses++; paused[1] = true }
    :: atomic { PAUSABLE(2) && pauses < MAX_PAUSES && alive[2] -> pauses++; paused[2] = true }
    :: atomic { paused[0] -> paused[0] = false }
    :: atomic { paused[1] -> paused[1] = false }
    :: atomic { paused[2] -> paused[2] = false }
    :: atomic { kills < MAX_KILLS && alive[0] -> x = 0; kill(x) }
    :: atomic { kills < MAX_KILLS && alive[1] -> x = 1; kill(x) }
    :: atomic { kills < MAX_KILLS && alive[2] -> x = 2; kill(x) }
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
