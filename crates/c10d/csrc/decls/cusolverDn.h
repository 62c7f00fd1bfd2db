// See cuda_libs.h: declarations only.
#pragma once
#include "cuda_libs.h"
