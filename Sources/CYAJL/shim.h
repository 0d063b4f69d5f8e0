#ifndef CHATCORE_CYAJL_SHIM_H
#define CHATCORE_CYAJL_SHIM_H
#include <yajl/yajl_parse.h>
#include <yajl/yajl_gen.h>
#include <yajl/yajl_version.h>

/* yajl_config is variadic, which Swift cannot call: one wrapper per option used. */
static inline int chatcore_yajl_allow_multiple_values(yajl_handle handle) {
    return yajl_config(handle, yajl_allow_multiple_values, 1);
}
#endif
