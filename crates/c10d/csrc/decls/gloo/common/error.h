// See rendezvous/store.h: declarations only.
#pragma once
#include <gloo/rendezvous/store.h>
