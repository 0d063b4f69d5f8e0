#ifndef CHATCORE_CYAJL_SHIM_H
#define CHATCORE_CYAJL_SHIM_H
#include <yajl/yajl_parse.h>
#include <yajl/yajl_gen.h>
#include <yajl/yajl_version.h>
#endif
