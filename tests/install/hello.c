/*
 * hello.c: the installed-package check's program, built against an installed
 * libkvfence (pkg-config and find_package). It creates a client to an address
 * where nothing listens and expects a clean UNAVAILABLE; exits 0 on that.
 */
#include <stdio.h>

#include <kvfence/kvfence.h>

int main(void)
{
    struct kvf_client_opts o;
    kvf_client_opts_init(&o);
    o.call_timeout_ms = 2000;
    struct kvf_status st;
    kvf_client *c = NULL;
    if (kvf_client_create("127.0.0.1:1", &o, &c, &st) != 0) {
        fprintf(stderr, "hello: create: %s\n", st.message);
        return 1;
    }
    struct kvf_room_key room = {.room_id = 1, .generation = 0};
    int rc = kvf_abort_room(c, room, "hello", NULL, &st);
    kvf_client_destroy(c);
    if (rc == 0) {
        fprintf(stderr, "hello: an abort against nothing succeeded\n");
        return 1;
    }
    printf("hello: %s (%s), as expected\n", kvf_status_name(rc), st.message);
    return rc == -KVF_STATUS_UNAVAILABLE || rc == -KVF_STATUS_DEADLINE_EXCEEDED ? 0 : 1;
}
