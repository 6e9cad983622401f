module proxyfleet/services/gateway

go 1.26.0

require proxyfleet/pkg v0.0.0

replace proxyfleet/pkg => ../../pkg
