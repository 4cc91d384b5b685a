/*
 * test_introspect.c: server reflection and the health registry, bytes in,
 * bytes out, as the RPC glue will drive them.
 *
 * Reflection runs over the real embedded descriptor set (kvf_api) for the
 * kvfence services, and over a small set built here for what the kvfence
 * protos do not have: nested messages, a diamond of imports, extensions.
 * Every answer is decoded back with the generated code and checked by name.
 * Health checks Check, the NOT_FOUND rule, Watch ordering and shutdown.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>

#include <cmocka.h>

#include "google/protobuf/descriptor.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"
#include "grpc/reflection/v1alpha/reflection.pb-c.h"
#include "health.h"
#include "kvf_api_descriptors.h"
#include "kvf_error.h"
#include "reflection.h"

typedef Grpc__Reflection__V1alpha__ServerReflectionRequest refl_request;
typedef Grpc__Reflection__V1alpha__ServerReflectionResponse refl_response;

#define REQ_CASE(x)  GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_##x
#define RESP_CASE(x) GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_##x

static const char *const kvfence_services[] = {"kvfence.v1.Control", "kvfence.v1.Admin",
                                               "kvfence.v1.NodeSession", "kvfence.v1.NodeLocal"};

static struct kvf_reflection *kvfence_reflection(void)
{
    struct kvf_reflection *refl = kvf_reflection_create(
        kvf_api_descriptor_set, kvf_api_descriptor_set_len, kvfence_services, 4);
    assert_non_null(refl);
    return refl;
}

/* Packs `rq`, hands it to the handler, decodes the answer (free with
 * grpc__reflection__v1alpha__server_reflection_response__free_unpacked). */
static refl_response *ask(struct kvf_reflection *refl, refl_request *rq)
{
    size_t len = grpc__reflection__v1alpha__server_reflection_request__get_packed_size(rq);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    grpc__reflection__v1alpha__server_reflection_request__pack(rq, buf);
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    assert_int_equal(kvf_reflection_handle(refl, buf, len, &resp, &resp_len), 0);
    free(buf);
    refl_response *rs =
        grpc__reflection__v1alpha__server_reflection_response__unpack(NULL, resp_len, resp);
    free(resp);
    assert_non_null(rs);
    return rs;
}

static refl_response *ask_symbol(struct kvf_reflection *refl, const char *symbol)
{
    refl_request rq = GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__INIT;
    rq.message_request_case = REQ_CASE(FILE_CONTAINING_SYMBOL);
    rq.file_containing_symbol = (char *)symbol;
    return ask(refl, &rq);
}

static refl_response *ask_file(struct kvf_reflection *refl, const char *file)
{
    refl_request rq = GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__INIT;
    rq.message_request_case = REQ_CASE(FILE_BY_FILENAME);
    rq.file_by_filename = (char *)file;
    return ask(refl, &rq);
}

static void free_response(refl_response *rs)
{
    grpc__reflection__v1alpha__server_reflection_response__free_unpacked(rs, NULL);
}

/* Checks that `rs` is a file_descriptor_response holding exactly the files
 * `names` (a NULL-terminated list), the first one first, the rest in any
 * order, each once. */
static void expect_files(const refl_response *rs, const char *const *names)
{
    assert_int_equal(rs->message_response_case, RESP_CASE(FILE_DESCRIPTOR_RESPONSE));
    const Grpc__Reflection__V1alpha__FileDescriptorResponse *fdr = rs->file_descriptor_response;
    size_t n = 0;
    while (names[n])
        n++;
    assert_int_equal(fdr->n_file_descriptor_proto, n);
    int found[16] = {0};
    assert_true(n <= 16);
    for (size_t i = 0; i < fdr->n_file_descriptor_proto; i++) {
        Google__Protobuf__FileDescriptorProto *fp = google__protobuf__file_descriptor_proto__unpack(
            NULL, fdr->file_descriptor_proto[i].len, fdr->file_descriptor_proto[i].data);
        assert_non_null(fp);
        assert_non_null(fp->name);
        if (i == 0)
            assert_string_equal(fp->name, names[0]);
        size_t j = 0;
        while (j < n && strcmp(names[j], fp->name) != 0)
            j++;
        if (j == n)
            fail_msg("unexpected file %s", fp->name);
        assert_int_equal(found[j]++, 0);
        google__protobuf__file_descriptor_proto__free_unpacked(fp, NULL);
    }
}

static void expect_not_found(const refl_response *rs, const char *named)
{
    assert_int_equal(rs->message_response_case, RESP_CASE(ERROR_RESPONSE));
    assert_int_equal(rs->error_response->error_code, KVF_GRPC_NOT_FOUND);
    assert_non_null(strstr(rs->error_response->error_message, named));
}

/* ---- reflection over the kvfence descriptor set ---------------------- */

static void list_services_names_every_service(void **state)
{
    (void)state;
    struct kvf_reflection *refl = kvfence_reflection();
    refl_request rq = GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__INIT;
    rq.message_request_case = REQ_CASE(LIST_SERVICES);
    rq.list_services = "*";
    refl_response *rs = ask(refl, &rq);
    assert_int_equal(rs->message_response_case, RESP_CASE(LIST_SERVICES_RESPONSE));
    static const char *const want[] = {
        "kvfence.v1.Control",
        "kvfence.v1.Admin",
        "kvfence.v1.NodeSession",
        "kvfence.v1.NodeLocal",
        KVF_REFLECTION_SERVICE_V1ALPHA,
        KVF_REFLECTION_SERVICE_V1,
        KVF_HEALTH_SERVICE,
    };
    assert_int_equal(rs->list_services_response->n_service, 7);
    for (size_t i = 0; i < 7; i++)
        assert_string_equal(rs->list_services_response->service[i]->name, want[i]);
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void list_services_does_not_repeat_a_name(void **state)
{
    (void)state;
    const char *names[] = {"kvfence.v1.Control", KVF_HEALTH_SERVICE, "kvfence.v1.Control"};
    struct kvf_reflection *refl =
        kvf_reflection_create(kvf_api_descriptor_set, kvf_api_descriptor_set_len, names, 3);
    assert_non_null(refl);
    refl_request rq = GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__INIT;
    rq.message_request_case = REQ_CASE(LIST_SERVICES);
    rq.list_services = "";
    refl_response *rs = ask(refl, &rq);
    assert_int_equal(rs->list_services_response->n_service, 4);
    assert_string_equal(rs->list_services_response->service[0]->name, "kvfence.v1.Control");
    assert_string_equal(rs->list_services_response->service[1]->name, KVF_HEALTH_SERVICE);
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void response_echoes_request_and_host(void **state)
{
    (void)state;
    struct kvf_reflection *refl = kvfence_reflection();
    refl_request rq = GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__INIT;
    rq.host = "localhost:7000";
    rq.message_request_case = REQ_CASE(FILE_CONTAINING_SYMBOL);
    rq.file_containing_symbol = "kvfence.v1.Control";
    refl_response *rs = ask(refl, &rq);
    assert_string_equal(rs->valid_host, "localhost:7000");
    assert_non_null(rs->original_request);
    assert_string_equal(rs->original_request->host, "localhost:7000");
    assert_int_equal(rs->original_request->message_request_case, REQ_CASE(FILE_CONTAINING_SYMBOL));
    assert_string_equal(rs->original_request->file_containing_symbol, "kvfence.v1.Control");
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void service_symbol_gives_file_and_imports(void **state)
{
    (void)state;
    struct kvf_reflection *refl = kvfence_reflection();
    static const char *const control[] = {"kvfence/v1/control.proto", "kvfence/v1/types.proto",
                                          NULL};
    static const char *const node[] = {"kvfence/v1/node.proto", "kvfence/v1/types.proto", NULL};
    refl_response *rs = ask_symbol(refl, "kvfence.v1.Control");
    expect_files(rs, control);
    free_response(rs);
    rs = ask_symbol(refl, "kvfence.v1.Admin");
    expect_files(rs, control);
    free_response(rs);
    rs = ask_symbol(refl, "kvfence.v1.NodeSession");
    expect_files(rs, node);
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void message_enum_and_value_symbols(void **state)
{
    (void)state;
    struct kvf_reflection *refl = kvfence_reflection();
    static const char *const control[] = {"kvfence/v1/control.proto", "kvfence/v1/types.proto",
                                          NULL};
    static const char *const types[] = {"kvfence/v1/types.proto", NULL};
    static const char *const health[] = {"grpc/health/v1/health.proto", NULL};
    static const struct {
        const char *symbol;
        const char *const *files;
    } cases[] = {
        {"kvfence.v1.JoinRoomRequest", control},
        {".kvfence.v1.JoinRoomRequest", control}, /* leading dot, as in type_name */
        {"kvfence.v1.JoinRoomRequest.room_id", control},
        {"kvfence.v1.PageRange", types},
        {"kvfence.v1.Role", types},
        {"kvfence.v1.ROLE_SINK", types},      /* protobuf's scope for enum values */
        {"kvfence.v1.Role.ROLE_SINK", types}, /* the generous one */
        {"grpc.health.v1.HealthCheckResponse", health},
        {"grpc.health.v1.HealthCheckResponse.ServingStatus", health}, /* nested enum */
        {"grpc.health.v1.HealthCheckResponse.SERVING", health},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        refl_response *rs = ask_symbol(refl, cases[i].symbol);
        expect_files(rs, cases[i].files);
        free_response(rs);
    }
    kvf_reflection_destroy(refl);
}

static void method_symbols(void **state)
{
    (void)state;
    struct kvf_reflection *refl = kvfence_reflection();
    static const char *const control[] = {"kvfence/v1/control.proto", "kvfence/v1/types.proto",
                                          NULL};
    static const char *const health[] = {"grpc/health/v1/health.proto", NULL};
    static const char *const refl_v1[] = {"grpc/reflection/v1/reflection.proto", NULL};
    static const char *const refl_v1alpha[] = {"grpc/reflection/v1alpha/reflection.proto", NULL};
    refl_response *rs = ask_symbol(refl, "kvfence.v1.Control.JoinRoom");
    expect_files(rs, control);
    free_response(rs);
    rs = ask_symbol(refl, "kvfence.v1.Control/JoinRoom");
    expect_files(rs, control);
    free_response(rs);
    rs = ask_symbol(refl, "kvfence.v1.Admin.Ping");
    expect_files(rs, control);
    free_response(rs);
    rs = ask_symbol(refl, "grpc.health.v1.Health.Watch");
    expect_files(rs, health);
    free_response(rs);
    rs = ask_symbol(refl, "grpc.reflection.v1.ServerReflection.ServerReflectionInfo");
    expect_files(rs, refl_v1);
    free_response(rs);
    rs = ask_symbol(refl, KVF_REFLECTION_SERVICE_V1ALPHA);
    expect_files(rs, refl_v1alpha);
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void file_by_filename(void **state)
{
    (void)state;
    struct kvf_reflection *refl = kvfence_reflection();
    static const char *const node[] = {"kvfence/v1/node.proto", "kvfence/v1/types.proto", NULL};
    static const char *const peer[] = {"kvfence/v1/peer.proto", "kvfence/v1/types.proto", NULL};
    static const char *const types[] = {"kvfence/v1/types.proto", NULL};
    refl_response *rs = ask_file(refl, "kvfence/v1/node.proto");
    expect_files(rs, node);
    free_response(rs);
    rs = ask_file(refl, "kvfence/v1/peer.proto");
    expect_files(rs, peer);
    free_response(rs);
    rs = ask_file(refl, "kvfence/v1/types.proto");
    expect_files(rs, types);
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void served_bytes_are_the_set_entries(void **state)
{
    (void)state;
    struct kvf_reflection *refl = kvfence_reflection();
    refl_response *rs = ask_file(refl, "kvfence/v1/types.proto");
    const ProtobufCBinaryData *b = &rs->file_descriptor_response->file_descriptor_proto[0];
    /* The entry is served as protoc wrote it: the very bytes are in the set. */
    assert_true(b->len > 0);
    assert_non_null(memmem(kvf_api_descriptor_set, kvf_api_descriptor_set_len, b->data, b->len));
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void unknown_symbol_and_file_are_not_found(void **state)
{
    (void)state;
    struct kvf_reflection *refl = kvfence_reflection();
    refl_response *rs = ask_symbol(refl, "kvfence.v1.NoSuchThing");
    expect_not_found(rs, "kvfence.v1.NoSuchThing");
    free_response(rs);
    rs = ask_symbol(refl, "");
    assert_int_equal(rs->message_response_case, RESP_CASE(ERROR_RESPONSE));
    assert_int_equal(rs->error_response->error_code, KVF_GRPC_NOT_FOUND);
    free_response(rs);
    rs = ask_symbol(refl, "kvfence.v1"); /* a package is not a symbol */
    expect_not_found(rs, "kvfence.v1");
    free_response(rs);
    rs = ask_file(refl, "kvfence/v1/nope.proto");
    expect_not_found(rs, "kvfence/v1/nope.proto");
    free_response(rs);

    refl_request rq = GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__INIT;
    rq.message_request_case = REQ_CASE(ALL_EXTENSION_NUMBERS_OF_TYPE);
    rq.all_extension_numbers_of_type = "kvfence.v1.Nope";
    rs = ask(refl, &rq);
    expect_not_found(rs, "kvfence.v1.Nope");
    free_response(rs);

    Grpc__Reflection__V1alpha__ExtensionRequest er =
        GRPC__REFLECTION__V1ALPHA__EXTENSION_REQUEST__INIT;
    er.containing_type = "kvfence.v1.PageRange";
    er.extension_number = 1000;
    rq.message_request_case = REQ_CASE(FILE_CONTAINING_EXTENSION);
    rq.file_containing_extension = &er;
    rs = ask(refl, &rq);
    expect_not_found(rs, "kvfence.v1.PageRange");
    free_response(rs);

    /* A known message with no extensions: an empty list, not an error. */
    rq.message_request_case = REQ_CASE(ALL_EXTENSION_NUMBERS_OF_TYPE);
    rq.all_extension_numbers_of_type = "kvfence.v1.PageRange";
    rs = ask(refl, &rq);
    assert_int_equal(rs->message_response_case, RESP_CASE(ALL_EXTENSION_NUMBERS_RESPONSE));
    assert_string_equal(rs->all_extension_numbers_response->base_type_name, "kvfence.v1.PageRange");
    assert_int_equal(rs->all_extension_numbers_response->n_extension_number, 0);
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void empty_request_is_unimplemented(void **state)
{
    (void)state;
    struct kvf_reflection *refl = kvfence_reflection();
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    assert_int_equal(kvf_reflection_handle(refl, NULL, 0, &resp, &resp_len), 0);
    refl_response *rs =
        grpc__reflection__v1alpha__server_reflection_response__unpack(NULL, resp_len, resp);
    free(resp);
    assert_non_null(rs);
    assert_int_equal(rs->message_response_case, RESP_CASE(ERROR_RESPONSE));
    assert_int_equal(rs->error_response->error_code, KVF_GRPC_UNIMPLEMENTED);
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void malformed_request_is_einval(void **state)
{
    (void)state;
    struct kvf_reflection *refl = kvfence_reflection();
    static const uint8_t bad[][6] = {
        {0x22, 0x05, 'k', 'v'},               /* symbol: length 5, 2 bytes there */
        {0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, /* a key that never ends */
        {0x3a, 0x80},                         /* length varint cut short */
        {0x2a, 0x02, 0x0a, 0x09},             /* extension request, inner string cut */
        {0x0f},                               /* wire type 7 */
    };
    static const size_t lens[] = {4, 6, 2, 4, 1};
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        uint8_t *resp = (uint8_t *)0x1;
        size_t resp_len = 77;
        assert_int_equal(kvf_reflection_handle(refl, bad[i], lens[i], &resp, &resp_len), -EINVAL);
        assert_ptr_equal(resp, (uint8_t *)0x1); /* untouched */
        assert_int_equal(resp_len, 77);
    }
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    assert_int_equal(kvf_reflection_handle(refl, NULL, 3, &resp, &resp_len), -EINVAL);
    assert_int_equal(kvf_reflection_handle(NULL, bad[0], 4, &resp, &resp_len), -EINVAL);
    kvf_reflection_destroy(refl);
}

/* ---- reflection over a set built here -------------------------------- */

struct set_builder {
    uint8_t *buf;
    size_t len;
};

static void set_add(struct set_builder *sb, const Google__Protobuf__FileDescriptorProto *fp)
{
    size_t n = google__protobuf__file_descriptor_proto__get_packed_size(fp);
    sb->buf = realloc(sb->buf, sb->len + 11 + n);
    assert_non_null(sb->buf);
    sb->buf[sb->len++] = 0x0a;
    size_t v = n;
    do {
        uint8_t b = v & 0x7f;
        v >>= 7;
        sb->buf[sb->len++] = b | (v ? 0x80 : 0);
    } while (v);
    google__protobuf__file_descriptor_proto__pack(fp, sb->buf + sb->len);
    sb->len += n;
}

/*
 * t/root.proto     package t.root; message Root { extensions 100 to 199; }
 * t/left.proto     imports root;  extend t.root.Root { int32 left = 100; }
 * t/right.proto    imports root
 * t/top.proto      imports left, right, root: a diamond;
 *                  package t; message Outer { message Inner { enum Deep {D0 = 0;} } }
 *                  extend t.root.Root { int32 top = 101; }
 */
static struct kvf_reflection *diamond_reflection(void)
{
    struct set_builder sb = {0};

    Google__Protobuf__DescriptorProto root_msg = GOOGLE__PROTOBUF__DESCRIPTOR_PROTO__INIT;
    root_msg.name = "Root";
    Google__Protobuf__DescriptorProto *root_msgs[] = {&root_msg};
    Google__Protobuf__FileDescriptorProto root = GOOGLE__PROTOBUF__FILE_DESCRIPTOR_PROTO__INIT;
    root.name = "t/root.proto";
    root.package = "t.root";
    root.n_message_type = 1;
    root.message_type = root_msgs;
    set_add(&sb, &root);

    Google__Protobuf__FieldDescriptorProto left_ext =
        GOOGLE__PROTOBUF__FIELD_DESCRIPTOR_PROTO__INIT;
    left_ext.name = "left";
    left_ext.has_number = 1;
    left_ext.number = 100;
    left_ext.extendee = ".t.root.Root";
    Google__Protobuf__FieldDescriptorProto *left_exts[] = {&left_ext};
    char *left_deps[] = {"t/root.proto"};
    Google__Protobuf__FileDescriptorProto left = GOOGLE__PROTOBUF__FILE_DESCRIPTOR_PROTO__INIT;
    left.name = "t/left.proto";
    left.package = "t.left";
    left.n_dependency = 1;
    left.dependency = left_deps;
    left.n_extension = 1;
    left.extension = left_exts;
    set_add(&sb, &left);

    Google__Protobuf__FileDescriptorProto right = GOOGLE__PROTOBUF__FILE_DESCRIPTOR_PROTO__INIT;
    right.name = "t/right.proto";
    right.package = "t.right";
    right.n_dependency = 1;
    right.dependency = left_deps;
    set_add(&sb, &right);

    Google__Protobuf__EnumValueDescriptorProto d0 =
        GOOGLE__PROTOBUF__ENUM_VALUE_DESCRIPTOR_PROTO__INIT;
    d0.name = "D0";
    d0.has_number = 1;
    Google__Protobuf__EnumValueDescriptorProto *d_values[] = {&d0};
    Google__Protobuf__EnumDescriptorProto deep = GOOGLE__PROTOBUF__ENUM_DESCRIPTOR_PROTO__INIT;
    deep.name = "Deep";
    deep.n_value = 1;
    deep.value = d_values;
    Google__Protobuf__EnumDescriptorProto *deeps[] = {&deep};
    Google__Protobuf__DescriptorProto inner = GOOGLE__PROTOBUF__DESCRIPTOR_PROTO__INIT;
    inner.name = "Inner";
    inner.n_enum_type = 1;
    inner.enum_type = deeps;
    Google__Protobuf__DescriptorProto *inners[] = {&inner};
    Google__Protobuf__DescriptorProto outer = GOOGLE__PROTOBUF__DESCRIPTOR_PROTO__INIT;
    outer.name = "Outer";
    outer.n_nested_type = 1;
    outer.nested_type = inners;
    Google__Protobuf__DescriptorProto *outers[] = {&outer};
    Google__Protobuf__FieldDescriptorProto top_ext = GOOGLE__PROTOBUF__FIELD_DESCRIPTOR_PROTO__INIT;
    top_ext.name = "top";
    top_ext.has_number = 1;
    top_ext.number = 101;
    top_ext.extendee = ".t.root.Root";
    Google__Protobuf__FieldDescriptorProto *top_exts[] = {&top_ext};
    char *top_deps[] = {"t/left.proto", "t/right.proto", "t/root.proto"};
    Google__Protobuf__FileDescriptorProto top = GOOGLE__PROTOBUF__FILE_DESCRIPTOR_PROTO__INIT;
    top.name = "t/top.proto";
    top.package = "t";
    top.n_dependency = 3;
    top.dependency = top_deps;
    top.n_message_type = 1;
    top.message_type = outers;
    top.n_extension = 1;
    top.extension = top_exts;
    set_add(&sb, &top);

    struct kvf_reflection *refl = kvf_reflection_create(sb.buf, sb.len, NULL, 0);
    free(sb.buf); /* create copied it */
    assert_non_null(refl);
    return refl;
}

static void nested_symbols_and_diamond_imports(void **state)
{
    (void)state;
    struct kvf_reflection *refl = diamond_reflection();
    static const char *const top[] = {"t/top.proto", "t/left.proto", "t/right.proto",
                                      "t/root.proto", NULL};
    static const char *const left[] = {"t/left.proto", "t/root.proto", NULL};
    static const char *const root[] = {"t/root.proto", NULL};
    static const struct {
        const char *symbol;
        const char *const *files;
    } cases[] = {
        {"t.Outer", top},          {"t.Outer.Inner", top}, {"t.Outer.Inner.Deep", top},
        {"t.Outer.Inner.D0", top}, {"t.top", top},         {"t.left.left", left},
        {"t.root.Root", root},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        refl_response *rs = ask_symbol(refl, cases[i].symbol);
        expect_files(rs, cases[i].files);
        free_response(rs);
    }
    refl_response *rs = ask_file(refl, "t/top.proto");
    expect_files(rs, top); /* root.proto once, though three paths lead to it */
    free_response(rs);
    rs = ask_symbol(refl, "t.Inner");
    expect_not_found(rs, "t.Inner");
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void extension_requests(void **state)
{
    (void)state;
    struct kvf_reflection *refl = diamond_reflection();
    refl_request rq = GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__INIT;
    rq.message_request_case = REQ_CASE(ALL_EXTENSION_NUMBERS_OF_TYPE);
    rq.all_extension_numbers_of_type = "t.root.Root";
    refl_response *rs = ask(refl, &rq);
    assert_int_equal(rs->message_response_case, RESP_CASE(ALL_EXTENSION_NUMBERS_RESPONSE));
    const Grpc__Reflection__V1alpha__ExtensionNumberResponse *enr =
        rs->all_extension_numbers_response;
    assert_string_equal(enr->base_type_name, "t.root.Root");
    assert_int_equal(enr->n_extension_number, 2);
    assert_int_equal(enr->extension_number[0] + enr->extension_number[1], 201);
    free_response(rs);

    /* An enum is not a message type. */
    rq.all_extension_numbers_of_type = "t.Outer.Inner.Deep";
    rs = ask(refl, &rq);
    expect_not_found(rs, "t.Outer.Inner.Deep");
    free_response(rs);

    Grpc__Reflection__V1alpha__ExtensionRequest er =
        GRPC__REFLECTION__V1ALPHA__EXTENSION_REQUEST__INIT;
    er.containing_type = ".t.root.Root";
    er.extension_number = 101;
    rq.message_request_case = REQ_CASE(FILE_CONTAINING_EXTENSION);
    rq.file_containing_extension = &er;
    rs = ask(refl, &rq);
    static const char *const top[] = {"t/top.proto", "t/left.proto", "t/right.proto",
                                      "t/root.proto", NULL};
    expect_files(rs, top);
    free_response(rs);
    er.extension_number = 102;
    rs = ask(refl, &rq);
    expect_not_found(rs, "t.root.Root");
    free_response(rs);
    kvf_reflection_destroy(refl);
}

static void create_refuses_bad_sets(void **state)
{
    (void)state;
    const char *svc[] = {"x.Y"};
    /* Truncated: the last entry's length runs past the end. */
    assert_null(
        kvf_reflection_create(kvf_api_descriptor_set, kvf_api_descriptor_set_len - 1, svc, 1));
    /* An entry that is not a FileDescriptorProto (a field with wire type 7). */
    static const uint8_t junk[] = {0x0a, 0x01, 0x0f};
    assert_null(kvf_reflection_create(junk, sizeof(junk), svc, 1));
    /* The same file twice. */
    size_t n = kvf_api_descriptor_set_len;
    uint8_t *twice = malloc(2 * n);
    assert_non_null(twice);
    memcpy(twice, kvf_api_descriptor_set, n);
    memcpy(twice + n, kvf_api_descriptor_set, n);
    assert_null(kvf_reflection_create(twice, 2 * n, svc, 1));
    free(twice);
    /* A message without a name. */
    Google__Protobuf__DescriptorProto nameless = GOOGLE__PROTOBUF__DESCRIPTOR_PROTO__INIT;
    Google__Protobuf__DescriptorProto *msgs[] = {&nameless};
    Google__Protobuf__FileDescriptorProto fp = GOOGLE__PROTOBUF__FILE_DESCRIPTOR_PROTO__INIT;
    fp.name = "t/nameless.proto";
    fp.n_message_type = 1;
    fp.message_type = msgs;
    struct set_builder sb = {0};
    set_add(&sb, &fp);
    assert_null(kvf_reflection_create(sb.buf, sb.len, svc, 1));
    free(sb.buf);
    /* A NULL service name. */
    const char *null_svc[] = {NULL};
    assert_null(kvf_reflection_create(kvf_api_descriptor_set, n, null_svc, 1));
    /* An empty set is valid: it only lists services. */
    struct kvf_reflection *refl = kvf_reflection_create(NULL, 0, svc, 1);
    assert_non_null(refl);
    refl_response *rs = ask_symbol(refl, "x.Y");
    expect_not_found(rs, "x.Y");
    free_response(rs);
    kvf_reflection_destroy(refl);
    kvf_reflection_destroy(NULL);
}

/* ---- health ---------------------------------------------------------- */

static uint8_t *health_request(const char *service, size_t *len_p)
{
    Grpc__Health__V1__HealthCheckRequest rq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    rq.service = (char *)service;
    size_t len = grpc__health__v1__health_check_request__get_packed_size(&rq);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    grpc__health__v1__health_check_request__pack(&rq, buf);
    *len_p = len;
    return buf;
}

/* Runs Check on `service`; returns the gRPC code, and the status in *status_p
 * when the code is OK. */
static int check(struct kvf_health *h, const char *service, int *status_p)
{
    size_t len;
    uint8_t *req = health_request(service, &len);
    uint8_t *resp = (uint8_t *)0x1;
    size_t resp_len = 99;
    int code = -1;
    assert_int_equal(kvf_health_check(h, req, len, &resp, &resp_len, &code), 0);
    free(req);
    if (code != KVF_GRPC_OK) {
        assert_null(resp);
        assert_int_equal(resp_len, 0);
        return code;
    }
    Grpc__Health__V1__HealthCheckResponse *rs =
        grpc__health__v1__health_check_response__unpack(NULL, resp_len, resp);
    assert_non_null(rs);
    *status_p = (int)rs->status;
    grpc__health__v1__health_check_response__free_unpacked(rs, NULL);
    free(resp);
    return code;
}

static void health_overall_serving_then_not(void **state)
{
    (void)state;
    struct kvf_health *h = kvf_health_create();
    assert_non_null(h);
    int status = -1;
    assert_int_equal(check(h, "", &status), KVF_GRPC_OK);
    assert_int_equal(status, KVF_HEALTH_SERVING);
    assert_int_equal(kvf_health_set(h, "", KVF_HEALTH_NOT_SERVING), 0);
    assert_int_equal(check(h, "", &status), KVF_GRPC_OK);
    assert_int_equal(status, KVF_HEALTH_NOT_SERVING);

    assert_int_equal(kvf_health_set(h, "kvfence.v1.Control", KVF_HEALTH_SERVING), 0);
    assert_int_equal(check(h, "kvfence.v1.Control", &status), KVF_GRPC_OK);
    assert_int_equal(status, KVF_HEALTH_SERVING);
    assert_int_equal(check(h, "", &status), KVF_GRPC_OK);
    assert_int_equal(status, KVF_HEALTH_NOT_SERVING);

    assert_int_equal(kvf_health_set(h, "", KVF_HEALTH_SERVICE_UNKNOWN), -EINVAL);
    assert_int_equal(kvf_health_set(h, "", KVF_HEALTH_UNKNOWN), -EINVAL);
    assert_int_equal(kvf_health_set(h, NULL, KVF_HEALTH_SERVING), -EINVAL);
    kvf_health_destroy(h);
    kvf_health_destroy(NULL);
}

static void health_unknown_service_is_not_found(void **state)
{
    (void)state;
    struct kvf_health *h = kvf_health_create();
    assert_non_null(h);
    int status = -1;
    assert_int_equal(check(h, "kvfence.v1.Nope", &status), KVF_GRPC_NOT_FOUND);
    kvf_health_destroy(h);
}

static void health_malformed_request_is_einval(void **state)
{
    (void)state;
    struct kvf_health *h = kvf_health_create();
    assert_non_null(h);
    static const uint8_t bad[] = {0x0a, 0x09, 'x'};
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    int code = -1;
    assert_int_equal(kvf_health_check(h, bad, sizeof(bad), &resp, &resp_len, &code), -EINVAL);
    assert_int_equal(code, -1);
    assert_int_equal(kvf_health_watch_add_request(h, bad, sizeof(bad), NULL, NULL), -EINVAL);
    /* No bytes at all is a valid request for "". */
    assert_int_equal(kvf_health_check(h, NULL, 0, &resp, &resp_len, &code), 0);
    assert_int_equal(code, KVF_GRPC_OK);
    free(resp);
    kvf_health_destroy(h);
}

#define WATCH_MAX 16

struct watch_log {
    int statuses[WATCH_MAX];
    size_t n;
};

static void watch_cb(void *ctx, const uint8_t *resp, size_t len)
{
    struct watch_log *log = ctx;
    Grpc__Health__V1__HealthCheckResponse *rs =
        grpc__health__v1__health_check_response__unpack(NULL, len, resp);
    assert_non_null(rs);
    assert_true(log->n < WATCH_MAX);
    log->statuses[log->n++] = (int)rs->status;
    grpc__health__v1__health_check_response__free_unpacked(rs, NULL);
}

static void health_watch_current_then_changes(void **state)
{
    (void)state;
    struct kvf_health *h = kvf_health_create();
    assert_non_null(h);
    struct watch_log all = {0}, ctl = {0};

    assert_int_equal(kvf_health_watch_add(h, "", watch_cb, &all), 0);
    size_t len;
    uint8_t *req = health_request("kvfence.v1.Control", &len);
    assert_int_equal(kvf_health_watch_add_request(h, req, len, watch_cb, &ctl), 0);
    free(req);
    assert_int_equal(all.n, 1);
    assert_int_equal(all.statuses[0], KVF_HEALTH_SERVING);
    assert_int_equal(ctl.n, 1);
    assert_int_equal(ctl.statuses[0], KVF_HEALTH_SERVICE_UNKNOWN);

    assert_int_equal(kvf_health_set(h, "kvfence.v1.Control", KVF_HEALTH_SERVING), 0);
    assert_int_equal(kvf_health_set(h, "kvfence.v1.Control", KVF_HEALTH_SERVING), 0); /* same */
    assert_int_equal(kvf_health_set(h, "", KVF_HEALTH_NOT_SERVING), 0);
    assert_int_equal(kvf_health_set(h, "", KVF_HEALTH_SERVING), 0);
    assert_int_equal(all.n, 3);
    assert_int_equal(all.statuses[1], KVF_HEALTH_NOT_SERVING);
    assert_int_equal(all.statuses[2], KVF_HEALTH_SERVING);
    assert_int_equal(ctl.n, 2);
    assert_int_equal(ctl.statuses[1], KVF_HEALTH_SERVING);

    assert_int_equal(kvf_health_watch_remove(h, watch_cb, &all), 0);
    assert_int_equal(kvf_health_watch_remove(h, watch_cb, &all), -ENOENT);
    assert_int_equal(kvf_health_set(h, "", KVF_HEALTH_NOT_SERVING), 0);
    assert_int_equal(all.n, 3); /* nothing after remove */
    assert_int_equal(ctl.n, 2);

    /* Shutdown: every service NOT_SERVING, then set is refused. */
    kvf_health_shutdown(h);
    assert_int_equal(ctl.n, 3);
    assert_int_equal(ctl.statuses[2], KVF_HEALTH_NOT_SERVING);
    assert_int_equal(kvf_health_set(h, "kvfence.v1.Control", KVF_HEALTH_SERVING), -EPERM);
    int status = -1;
    assert_int_equal(check(h, "kvfence.v1.Control", &status), KVF_GRPC_OK);
    assert_int_equal(status, KVF_HEALTH_NOT_SERVING);
    kvf_health_shutdown(h);
    assert_int_equal(ctl.n, 3);

    /* The last watch is freed by destroy. */
    kvf_health_destroy(h);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(list_services_names_every_service),
        cmocka_unit_test(list_services_does_not_repeat_a_name),
        cmocka_unit_test(response_echoes_request_and_host),
        cmocka_unit_test(service_symbol_gives_file_and_imports),
        cmocka_unit_test(message_enum_and_value_symbols),
        cmocka_unit_test(method_symbols),
        cmocka_unit_test(file_by_filename),
        cmocka_unit_test(served_bytes_are_the_set_entries),
        cmocka_unit_test(unknown_symbol_and_file_are_not_found),
        cmocka_unit_test(empty_request_is_unimplemented),
        cmocka_unit_test(malformed_request_is_einval),
        cmocka_unit_test(nested_symbols_and_diamond_imports),
        cmocka_unit_test(extension_requests),
        cmocka_unit_test(create_refuses_bad_sets),
        cmocka_unit_test(health_overall_serving_then_not),
        cmocka_unit_test(health_unknown_service_is_not_found),
        cmocka_unit_test(health_malformed_request_is_einval),
        cmocka_unit_test(health_watch_current_then_changes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
